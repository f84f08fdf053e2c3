"""The sparse attention kernel against the model's dense-mask softmax (`Attention._softmax_attend`,
`_softmax_attend_batch`) over the same keys, and a tiny V4 model with kernels off vs on."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from engine.kernels import kernel_mode
from engine.models.v4.attention import Attention
from tests.engine.references import rel_err

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def reference(q, keys, mask, sinks, scale, batched=False):
    """The model's own torch softmax (kernels off) over dense keys and a mask."""
    module = SimpleNamespace(sinks=sinks, scale=scale)
    with kernel_mode("off"):
        if batched:
            return Attention._softmax_attend_batch(module, q, keys, mask)
        return Attention._softmax_attend(module, q, keys, mask)


def prefill_case(device, dtype, n_queries=37, n_heads=5, head_dim=48, window=8, prior=5, ratio=4, sink=0.0):
    """Queries at positions first..first+n_queries-1 (window keys start `prior` rows before the first),
    window `window`, entries w < (p + 1) // ratio. Returns the kernel's inputs and the dense mask."""
    g = torch.Generator().manual_seed(n_queries * 7 + head_dim)
    first = prior
    positions = torch.arange(first, first + n_queries)
    keys = torch.randn(prior + n_queries, head_dim, generator=g)
    n_entries = (first + n_queries) // ratio
    entries = torch.randn(n_entries, head_dim, generator=g)
    q = torch.randn(n_queries, n_heads, head_dim, generator=g)
    sinks = torch.randn(n_heads, generator=g) + sink
    hi = positions + 1  # window rows start at position 0
    lo = (hi - window).clamp(min=0)
    counts = (positions + 1) // ratio
    rows = torch.arange(keys.shape[0])
    window_mask = (rows[None, :] >= lo[:, None]) & (rows[None, :] < hi[:, None])
    to = dict(device=device)
    return (q.to(dtype=dtype, **to), keys.to(dtype=dtype, **to), lo.to(**to), hi.to(**to),
            entries.to(dtype=dtype, **to), sinks.to(**to), counts.to(**to), window_mask.to(**to))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sink", [0.0, 30.0, -30.0])  # sinks ordinary, dominant, negligible
def test_window_and_counted_entries_match_the_dense_mask(device, dtype, sink):
    from engine.kernels.sparse_attention import sparse_attention

    q, keys, lo, hi, entries, sinks, counts, window_mask = prefill_case(device, dtype, sink=sink)
    assert counts.min() == 1 and lo.min() == 0 and (hi - lo).min() < 8  # windows cut at the start
    counts[3] = 0  # a query that sees no entry
    ours = sparse_attention(q, keys, lo, hi, entries, sinks, 48**-0.5, entry_count=counts)
    entry_mask = torch.arange(entries.shape[0], device=device)[None, :] < counts[:, None]
    mask = torch.cat([window_mask, entry_mask], dim=1)
    expected = reference(q, torch.cat([keys, entries]), mask, sinks, 48**-0.5)
    assert ours.dtype == dtype and ours.shape == q.shape
    assert rel_err(expected, ours) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexed_entries_match_the_dense_mask(device, dtype):
    from engine.kernels.sparse_attention import sparse_attention

    q, keys, lo, hi, entries, sinks, counts, window_mask = prefill_case(device, dtype, n_queries=70, head_dim=64)
    g = torch.Generator().manual_seed(5)
    n_idx = 9  # not a multiple of the block
    idx = torch.full((q.shape[0], n_idx), -1, dtype=torch.int32)
    entry_mask = torch.zeros(q.shape[0], entries.shape[0], dtype=torch.bool)
    for t, count in enumerate(counts.tolist()):
        chosen = torch.randperm(count, generator=g)[: min(count, n_idx - t % 3)]  # some -1 in every row mix
        idx[t, : len(chosen)] = chosen.to(torch.int32)
        idx[t] = idx[t][torch.randperm(n_idx, generator=g)]  # -1 anywhere, any order
        entry_mask[t, chosen] = True
    idx, entry_mask = idx.to(device), entry_mask.to(device)
    ours = sparse_attention(q, keys, lo, hi, entries, sinks, 0.125, entry_idx=idx)
    expected = reference(q, torch.cat([keys, entries]), torch.cat([window_mask, entry_mask], dim=1), sinks, 0.125)
    assert rel_err(expected, ours) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_keys_per_sequence_match_the_batched_decode_softmax(device, dtype):
    from engine.kernels.sparse_attention import masked_attention

    g = torch.Generator().manual_seed(3)
    batch, n_heads, head_dim, n_keys = 6, 20, 40, 77  # heads span two blocks of 16
    q = torch.randn(batch, n_heads, head_dim, generator=g).to(device, dtype)
    keys = torch.randn(batch, n_keys, head_dim, generator=g).to(device, dtype)
    mask = torch.rand(batch, n_keys, generator=g) < 0.6
    mask[2] = False  # a row with no key: the sink takes everything, the output is 0
    mask = mask.to(device)
    sinks = torch.randn(n_heads, generator=g).to(device)
    ours = masked_attention(q, keys, mask, sinks, 0.3)
    expected = reference(q, keys, mask, sinks, 0.3, batched=True)
    assert rel_err(expected, ours) <= TOLERANCE[dtype]
    assert ours[2].abs().max() == 0
    shared = masked_attention(q, keys[0], None, sinks, 0.3)  # shared keys, no mask: the one-token decode
    assert rel_err(reference(q, keys[0], None, sinks, 0.3), shared) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_window_and_indexed_entries_per_sequence(device, dtype):
    """The batched decode's form: per-sequence window [B, W, D] with a validity mask, per-sequence
    entries [B, E, D] with top-k indices: the same as the concatenation the torch path attends."""
    from engine.kernels.sparse_attention import sparse_attention

    g = torch.Generator().manual_seed(4)
    batch, n_heads, head_dim, width, n_entries = 3, 4, 64, 10, 21
    q = torch.randn(batch, n_heads, head_dim, generator=g).to(device, dtype)
    window = torch.randn(batch, width, head_dim, generator=g).to(device, dtype)
    entries = torch.randn(batch, n_entries, head_dim, generator=g).to(device, dtype)
    valid = torch.arange(width)[None, :] >= torch.tensor([7, 0, 3])[:, None]  # sequences shorter than the window
    idx = torch.tensor([[4, 0, -1], [20, 3, 11], [-1, -1, -1]], dtype=torch.int32)
    entry_mask = torch.zeros(batch, n_entries, dtype=torch.bool)
    for b, row in enumerate(idx.tolist()):
        entry_mask[b, [i for i in row if i >= 0]] = True
    sinks = torch.randn(n_heads, generator=g).to(device)
    zeros = torch.zeros(batch, dtype=torch.int32, device=device)
    full = torch.full((batch,), width, dtype=torch.int32, device=device)
    ours = sparse_attention(q, window, zeros, full, entries, sinks, 0.125, entry_idx=idx.to(device),
                            window_mask=valid.to(device))
    keys, mask = torch.cat([window, entries], dim=1), torch.cat([valid, entry_mask], dim=1).to(device)
    assert rel_err(reference(q, keys, mask, sinks, 0.125, batched=True), ours) <= TOLERANCE[dtype]


def test_exactly_one_entry_form_is_required(device):
    from engine.kernels.sparse_attention import sparse_attention

    q, keys, lo, hi, entries, sinks, counts, _ = prefill_case(device, torch.float32, n_queries=3)
    with pytest.raises(ValueError):
        sparse_attention(q, keys, lo, hi, entries, sinks, 1.0)
    assert sparse_attention(q[:0], keys, lo[:0], hi[:0], None, sinks, 1.0).shape == (0, *q.shape[1:])


# ---- the model with kernels off vs on ----------------------------------------------------------

@contextlib.contextmanager
def only_attention_kernels():
    """Kernels on for the attention core and the indexer alone (whatever the global mode)."""
    from engine.kernels.dispatch import pinned

    with pinned(("masked_attention", "sparse_attention", "index_scores"), True):
        yield


@pytest.fixture
def small(device, tmp_path_factory):
    """The tiny model shrunk so that short prompts (the interpreter is slow) reach every case: a
    16-token window, a top-k of 4 CSA entries (16 tokens), HCA entries every 32 tokens."""
    import json

    if device.type != "cpu":
        pytest.skip("the model is loaded on the CPU; the GPU runs the bench8-width test below")
    from engine.models.v4 import load_model
    from engine.models.v4.config import read_config_dict
    from engine.models.v4.random_init import write_random_model_dir
    from tests.engine.references import TEST_VOCAB

    raw = read_config_dict("tiny")
    raw.update(sliding_window=16, index_topk=4)
    raw["compress_rates"]["heavily_compressed_attention"] = 32
    path = tmp_path_factory.mktemp("small") / "config.json"
    path.write_text(json.dumps(raw))
    directory = write_random_model_dir(path, tmp_path_factory.mktemp("small-model"), seed=0,
                                       vocab_size=TEST_VOCAB, dtype=torch.float32)
    return load_model(directory, dtype=torch.float32)


@pytest.mark.parametrize("batched", [True, False])
def test_small_model_with_kernels_matches_the_torch_path(device, small, batched):
    """Prompts past the window, the indexer's top-k and the first HCA entries, then decode steps: the
    batched decode path, or the per-sequence one (`_one_keys`). fp32: the same logits and tokens."""
    from tests.engine.test_decode_batch import lockstep

    lengths, steps = (45, 13), 3  # 45: 11 CSA entries (> top-k 4), one HCA entry; 13: under the top-k
    with kernel_mode("off"):
        expected, _, _ = lockstep(small, lengths, steps, batched=batched)
        with only_attention_kernels():  # the other kernels have tests of their own
            ours, _, _ = lockstep(small, lengths, steps, batched=batched)
    assert rel_err(expected, ours) <= 1e-4
    assert torch.equal(expected.argmax(-1), ours.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bench8_widths_with_kernels_match_the_torch_path(device, dtype):
    """64 heads of 512, a 512-entry top-k: the tile sizes the GPU runs in production."""
    from tests.engine.test_decode_batch import bench8_narrow, lockstep

    if device.type != "cuda":
        pytest.skip("bench8 widths need a GPU")
    model = bench8_narrow(dtype)
    model.decode_graphs.enabled = False
    lengths = (5, 300, 2100, 2300)  # the last two past the top-k (512 entries = 2048 tokens)
    with kernel_mode("off"):
        expected, _, _ = lockstep(model, lengths, 4, batched=True)
        with only_attention_kernels():
            ours, _, _ = lockstep(model, lengths, 4, batched=True)
    err = rel_err(expected, ours)
    print(f"bench8 {dtype}: kernels vs torch logits rel err {err:.2e}")
    if dtype == torch.float32:
        assert err <= 1e-4 and torch.equal(expected.argmax(-1), ours.argmax(-1))
    else:  # bf16 roundings differ a little in every layer, and can flip a near-tie of the indexer's top-k
        assert err <= 0.15  # (seen on an H200: 1e-2 to 2e-2, and 0.1 on one decode step of one sequence)
