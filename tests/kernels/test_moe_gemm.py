"""Routed-expert kernels on packed weights (engine.kernels.moe_gemm) against the plain-torch
reference and against the model's own expert code (V4 RoutedExperts, V4.1 MoE's expert loop).

Shapes are small and odd (I = 96 is no multiple of the 64-wide N tile, and fp8's 128 blocks cut
the stacked gate-up rows mid-tile) because the CPU interpreter is slow. Routing draws from all but
the last experts, so some experts get no token.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

pytest.importorskip("triton", reason="the kernels need Triton (the `gpu` extra); CI installs without it")

from engine.kernels.moe_align import align_slots, max_row_blocks
from engine.kernels.moe_gemm import moe_forward, moe_reference
from engine.models.v4.config import load_config
from engine.models.v4.moe import RoutedExperts
from engine.quant.packed import pack
from engine.models.v41.config import load_v41_config
from engine.models.v41.moe import MoE as V41MoE

HIDDEN, INTER, LIMIT = 256, 96, 2.0
BF16_ULP = 2.0**-7


def _experts(n_experts: int, fmt: str, block: int, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(n_experts, 2 * INTER, HIDDEN, generator=gen) * 0.1
    down = torch.randn(n_experts, HIDDEN, INTER, generator=gen) * 0.1
    if fmt == "bf16":
        gate_up, down = gate_up.bfloat16(), down.bfloat16()
    return pack(gate_up, fmt, block).to(device), pack(down, fmt, block).to(device)


def _routing(n_tokens: int, top_k: int, n_experts: int, device, seed: int = 0):
    """Distinct experts per token from the first n_experts - 2 (the last two stay empty)."""
    gen = torch.Generator().manual_seed(seed + 1)
    choices = [torch.randperm(n_experts - 2, generator=gen)[:top_k] for _ in range(n_tokens)]
    experts = torch.stack(choices) if choices else torch.zeros(0, top_k, dtype=torch.long)
    weights = torch.rand(n_tokens, top_k, generator=gen) + 0.1
    return weights.to(device), experts.to(device)


def _inputs(n_tokens, top_k, n_experts, fmt, block, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed + 2)
    x = torch.randn(n_tokens, HIDDEN, generator=gen).to(device=device, dtype=dtype)
    return (x, *_routing(n_tokens, top_k, n_experts, device, seed), *_experts(n_experts, fmt, block, device, seed))


def _assert_matches(out, ref, x, route_weights, route_experts, gate_up, down, v41):
    """fp32: tight. bf16: the kernel is no further from the fp32 result than the bf16 reference is
    (plus an ulp of slack: the matmuls add up in another order, so a rounding may tip the other way)."""
    assert out.dtype == ref.dtype == x.dtype and out.shape == ref.shape
    if x.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        return
    truth = moe_reference(x.float(), route_weights, route_experts, gate_up, down, LIMIT, v41)
    scale = truth.abs().max().item()
    kernel_err = (out.float() - truth).abs()
    ref_err = (ref.float() - truth).abs()
    assert kernel_err.max().item() <= 2 * ref_err.max().item() + BF16_ULP * scale
    assert kernel_err.mean().item() <= 1.5 * ref_err.mean().item() + 1e-3 * scale


CASES = [  # fmt, fp8 block, dtype, T, k, E, v41
    ("fp8", 128, torch.float32, 37, 6, 16, False),
    ("fp8", 128, torch.bfloat16, 9, 6, 8, True),
    ("fp8", 32, torch.float32, 1, 6, 8, False),
    ("fp8", 32, torch.bfloat16, 9, 2, 16, True),
    ("mxfp4", 32, torch.float32, 37, 6, 8, True),
    ("mxfp4", 32, torch.bfloat16, 9, 6, 16, False),
    ("mxfp4", 32, torch.float32, 1, 1, 16, False),
    ("mxfp4", 32, torch.bfloat16, 1, 1, 8, True),
    ("bf16", 1, torch.bfloat16, 37, 1, 8, False),
    ("bf16", 1, torch.float32, 5, 6, 16, True),
]


@pytest.mark.parametrize("fmt,block,dtype,n_tokens,top_k,n_experts,v41", CASES)
def test_moe_forward_matches_reference(device, fmt, block, dtype, n_tokens, top_k, n_experts, v41):
    args = _inputs(n_tokens, top_k, n_experts, fmt, block, dtype, device)
    out = moe_forward(*args, LIMIT, v41)
    ref = moe_reference(*args, LIMIT, v41)
    _assert_matches(out, ref, *args, v41)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt,block", [("fp8", 128), ("mxfp4", 32)])
def test_v4_matches_routed_experts(device, fmt, block, dtype):
    """The model's V4 RoutedExperts on the dequantized weights is the reference the kernel replaces."""
    x, route_weights, route_experts, gate_up, down = _inputs(13, 6, 16, fmt, block, dtype, device, seed=3)
    config = dataclasses.replace(load_config("tiny"), hidden_size=HIDDEN, moe_intermediate_size=INTER,
                                 n_routed_experts=16, experts_per_token=6, swiglu_limit=LIMIT)
    experts = RoutedExperts(config).to(device=device, dtype=dtype)
    experts.gate_up_proj.data = gate_up.dequantize(dtype)
    experts.down_proj.data = down.dequantize(dtype)
    with torch.no_grad():
        model_out = experts(x, route_weights, route_experts)
    out = moe_forward(x, route_weights, route_experts, gate_up, down, LIMIT, v41=False)
    _assert_matches(out, model_out, x, route_weights, route_experts, gate_up, down, v41=False)


class _FixedRoute(nn.Module):
    def __init__(self, weights, experts):
        super().__init__()
        self.weights, self.experts = weights, experts

    def forward(self, x, image_mask):
        return self.weights, self.experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt,block", [("fp8", 32), ("mxfp4", 32)])
def test_v41_matches_moe_expert_loop(device, fmt, block, dtype):
    """V4.1's MoE with fixed routing and a zeroed shared expert: its routed sum is the reference."""
    x, route_weights, route_experts, gate_up, down = _inputs(13, 6, 8, fmt, block, dtype, device, seed=4)
    config = dataclasses.replace(load_v41_config("tiny-v41"), hidden_size=HIDDEN, moe_intermediate_size=INTER,
                                 n_routed_experts=8, experts_per_token=6, swiglu_limit=LIMIT)
    moe = V41MoE(config).to(device=device, dtype=dtype)
    moe.gate = _FixedRoute(route_weights, route_experts)
    w13, w2 = gate_up.dequantize(dtype), down.dequantize(dtype)
    with torch.no_grad():
        for e, expert in enumerate(moe.experts):
            expert.w1.weight.copy_(w13[e, :INTER])
            expert.w3.weight.copy_(w13[e, INTER:])
            expert.w2.weight.copy_(w2[e])
        for linear in (moe.shared_experts.w1, moe.shared_experts.w2, moe.shared_experts.w3):
            linear.weight.zero_()
        model_out = moe(x)
    out = moe_forward(x, route_weights, route_experts, gate_up, down, LIMIT, v41=True)
    _assert_matches(out, model_out, x, route_weights, route_experts, gate_up, down, v41=True)


def test_deterministic(device):
    args = _inputs(9, 6, 16, "mxfp4", 32, torch.bfloat16, device, seed=5)
    first = moe_forward(*args, LIMIT, False)
    assert torch.equal(first, moe_forward(*args, LIMIT, False))
    first = moe_forward(*args, LIMIT, True)
    assert torch.equal(first, moe_forward(*args, LIMIT, True))


def test_combine_adds_in_ascending_expert_order(device):
    """A token whose experts are listed high to low sums in ascending expert order, as the model does:
    permuting a token's k choices (with their weights) leaves the bf16 output bitwise the same."""
    x, route_weights, route_experts, gate_up, down = _inputs(5, 6, 16, "fp8", 128, torch.bfloat16, device, seed=6)
    flipped = moe_forward(x, route_weights.flip(1), route_experts.flip(1), gate_up, down, LIMIT, False)
    assert torch.equal(moe_forward(x, route_weights, route_experts, gate_up, down, LIMIT, False), flipped)


def test_no_tokens(device):
    x, route_weights, route_experts, gate_up, down = _inputs(0, 2, 8, "bf16", 1, torch.bfloat16, device)
    assert moe_forward(x, route_weights, route_experts, gate_up, down, LIMIT, False).shape == (0, HIDDEN)


@pytest.mark.parametrize("n_tokens,top_k,n_experts", [(1, 6, 16), (37, 6, 8), (300, 1, 64), (64, 8, 256)])
def test_align_slots_blocks(n_tokens, top_k, n_experts):
    """Every block holds one expert's slots (padding = n_slots), each slot appears once, empty experts
    get no block, and the grid bound holds (CPU torch: no kernel involved)."""
    _, experts = _routing(n_tokens, top_k, n_experts, "cpu", seed=n_tokens)
    block_m = 16
    blocks = align_slots(experts, n_experts, block_m)
    n_slots = n_tokens * top_k
    used = int(blocks.rows_used)
    assert used % block_m == 0 and used // block_m <= blocks.max_blocks == max_row_blocks(n_slots, n_experts, block_m)
    slots = blocks.sorted_slots[:used].long()
    real = slots[slots < n_slots]
    assert sorted(real.tolist()) == list(range(n_slots))
    assert (blocks.sorted_slots[used:] == n_slots).all()
    flat = experts.flatten()
    for b in range(used // block_m):
        rows = slots[b * block_m : (b + 1) * block_m]
        rows = rows[rows < n_slots]
        assert len(rows) > 0 and (flat[rows] == blocks.block_expert[b]).all()
        assert torch.equal(rows, rows.sort().values)  # stable: slot order kept within an expert
    assert set(blocks.block_expert[: used // block_m].tolist()) == set(flat.tolist())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_capture(device):
    """The whole forward captures (no host sync) and replays with new routing."""
    x, route_weights, route_experts, gate_up, down = _inputs(4, 6, 16, "mxfp4", 32, torch.bfloat16, device)
    moe_forward(x, route_weights, route_experts, gate_up, down, LIMIT, False)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_forward(x, route_weights, route_experts, gate_up, down, LIMIT, False)
    new_weights, new_experts = _routing(4, 6, 16, device, seed=9)
    route_weights.copy_(new_weights)
    route_experts.copy_(new_experts)
    graph.replay()
    assert torch.equal(captured, moe_forward(x, route_weights, route_experts, gate_up, down, LIMIT, False))


@pytest.mark.parametrize("v41", [False, True])
def test_prefill_tiles(device, monkeypatch, v41):
    """The prefill tile set (64-row blocks, activation x weight^T), forced on a small batch."""
    monkeypatch.setattr("engine.kernels.moe_align.DECODE_SLOTS", 0)
    args = _inputs(11, 6, 8, "fp8", 128, torch.bfloat16, device, seed=7)
    _assert_matches(moe_forward(*args, LIMIT, v41), moe_reference(*args, LIMIT, v41), *args, v41)


def test_swapped_operands(device, monkeypatch):
    """The weight x activation^T variant of the decode tiles (quant_linear.SWAP_AB) gives the same result."""
    args = _inputs(5, 6, 8, "mxfp4", 32, torch.bfloat16, device, seed=8)
    monkeypatch.setattr("engine.kernels.quant_linear.SWAP_AB", True)
    _assert_matches(moe_forward(*args, LIMIT, False), moe_reference(*args, LIMIT, False), *args, False)
