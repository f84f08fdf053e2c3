"""The fused indexer scores against `IndexScorer` (forward and batched), and the kernel path's top-k
indices against `Indexer.select` / `select_batched` (the same entries, ties to the lower index)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.kernels import kernel_mode
from engine.models.v4.compressor import IndexScorer, Indexer

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-5}  # bf16 inputs: products exact in fp32 either way


def scorer(n_heads: int, head_dim: int) -> IndexScorer:
    return IndexScorer(SimpleNamespace(index_head_dim=head_dim, index_n_heads=n_heads, hidden_size=8))


def case(device, dtype, n_queries=9, n_heads=5, head_dim=24, n_entries=70, per_query=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_queries, n_heads, head_dim, generator=g).to(device, dtype)
    weights = torch.randn(n_queries, n_heads, generator=g).to(device)
    shape = (n_queries, n_entries, head_dim) if per_query else (n_entries, head_dim)
    keys = torch.randn(*shape, generator=g).to(device, dtype)
    return q, weights, keys


def close(reference, ours, dtype) -> bool:
    """-inf at the same places, and the finite scores within the tolerance of the largest."""
    finite = torch.isfinite(reference)
    if not torch.equal(finite, torch.isfinite(ours)):
        return False
    error = (reference[finite] - ours[finite]).abs().max()
    return bool(error <= TOLERANCE[dtype] * reference[finite].abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_keys_match_the_scorer_with_invisible_entries_at_minus_infinity(device, dtype):
    from engine.kernels.index_scores import index_scores

    q, weights, keys = case(device, dtype)
    counts = torch.tensor([0, 1, 5, 63, 64, 65, 70, 70, 33], device=device)  # blocks of 64: edges
    ours = index_scores(q, weights, keys, scorer(5, 24).softmax_scale, counts)
    visible = torch.arange(70, device=device)[None, :] < counts[:, None]
    expected = scorer(5, 24).to(device)(q, keys, weights).masked_fill(~visible, float("-inf"))
    assert ours.dtype == torch.float32 and ours.shape == (9, 70)
    assert close(expected, ours, dtype)
    assert torch.isinf(ours[0]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_query_keys_match_the_batched_scorer(device, dtype):
    from engine.kernels.index_scores import index_scores

    q, weights, keys = case(device, dtype, n_queries=4, n_heads=17, head_dim=32, n_entries=40, per_query=True)
    counts = torch.tensor([40, 0, 17, 39], device=device)
    ours = index_scores(q, weights, keys, 32**-0.5, counts)
    visible = torch.arange(40, device=device)[None, :] < counts[:, None]
    expected = scorer(17, 32).to(device).batched(q, keys, weights).masked_fill(~visible, float("-inf"))
    assert close(expected, ours, torch.float32)


def indexer(device, top_k=6, ratio=4, n_heads=5, head_dim=24):
    """An Indexer's selection state alone (no projections: select needs only these)."""
    module = Indexer.__new__(Indexer)
    torch.nn.Module.__init__(module)
    module.ratio, module.top_k, module.n_heads, module.head_dim = ratio, top_k, n_heads, head_dim
    module.scorer = scorer(n_heads, head_dim).to(device)
    return module


def as_sets(indices: torch.Tensor) -> list[set[int]]:
    return [{i for i in row if i >= 0} for row in indices.tolist()]


def test_top_k_indices_choose_what_select_chooses_ties_to_the_lower_index(device):
    q, weights, keys = case(device, torch.float32, n_queries=12, n_entries=30, seed=1)
    keys[10] = keys[3]  # equal scores: both reference and kernel keep the lower index first
    keys[20] = keys[3]
    module = indexer(device)
    positions = torch.arange(100, 112, device=device) - 88  # 12..23: 3 to 6 visible entries, then past top-k
    positions[-3:] = torch.tensor([80, 119, 119], device=device)
    with kernel_mode("off"):
        expected = module.select(q, weights, keys, positions)
    ours = module.top_k_indices(q, weights, keys, (positions + 1) // module.ratio)
    assert ours.dtype == torch.int32 and ours.shape == (12, 6)
    assert as_sets(ours) == [set(row.nonzero().flatten().tolist()) for row in expected]
    assert torch.equal(module.select(q, weights, keys, positions), expected)  # select's own kernel path


def test_batched_top_k_indices_choose_what_select_batched_chooses(device):
    q, weights, keys = case(device, torch.float32, n_queries=3, n_entries=25, per_query=True, seed=2)
    module = indexer(device)
    counts = torch.tensor([25, 4, 13], device=device)
    visible = torch.arange(25, device=device)[None, :] < counts[:, None]
    with kernel_mode("off"):
        expected = module.select_batched(q, weights, keys, visible, scored=True)
    ours = module.top_k_indices(q, weights, keys, counts)
    assert as_sets(ours) == [set(row.nonzero().flatten().tolist()) for row in expected]
    assert torch.equal(module.select_batched(q, weights, keys, visible, scored=True), expected)
