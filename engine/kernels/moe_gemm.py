"""Routed experts in Triton, reading quantized expert weights directly (fp8 / mxfp4 / bf16 `Packed`).

moe_forward runs three kernels over the expert-sorted, block-padded slots of `moe_align`:
  1. gate-up: each program gathers its block's token rows of x by slot (no permuted copy of x),
     multiplies them by an N tile of the expert's gate (rows 0..I-1) and up (rows I..2I-1)
     weights, decoded in registers, and applies the clamped SwiGLU;
  2. down: the intermediate times the expert's down tile, weighted, written to the slot's row of a
     [T, k, H] buffer, placed at the slot's rank among its token's experts (ascending expert id);
  3. combine: each token's k rows added in that order.
No atomics anywhere: the same inputs give bitwise the same output.

Rounding follows the model code (engine.models.v4.moe.RoutedExperts._grouped for V4,
engine.models.v41.moe.MoE for V4.1). Gate, up and the down output are rounded to x.dtype, as the
reference's matmuls return x.dtype. V4: SwiGLU in x.dtype (silu rounded, then the product), the
slot's output times its routing weight rounded to x.dtype, the k outputs summed in x.dtype.
V4.1: SwiGLU in fp32 times the routing weight, rounded to x.dtype before the down projection; the
k outputs summed in fp32, then cast. Differences from the references: summation order inside the
matmuls, and silu's exp (the GPU's exp2-based exp, within an ulp or two of fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.kernels.moe_align import align_slots, moe_tiles
from engine.kernels.quant_linear import accumulate_tile, cast, dot_precision, mma_in_fp32, rne_by_hand, weight_args
from engine.quant.packed import Packed


@triton.jit
def _gate_up_kernel(
    x_ptr, slots_ptr, block_expert_ptr, rows_used_ptr, route_weight_ptr, data_ptr, scale_ptr, out_ptr,
    n_slots, stride_xt, stride_de, stride_dn, stride_se, stride_sn, stride_sk, limit,
    TOP_K: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
    FMT: tl.constexpr, V41: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    PRECISION: tl.constexpr, MMA_FP32: tl.constexpr, RNE_BY_HAND: tl.constexpr, SWAP: tl.constexpr,
):
    """out[row, n] = SwiGLU(x[token(row)] . gate[n], x[token(row)] . up[n]) for one block of rows."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BM >= tl.load(rows_used_ptr):
        return  # past the blocks in use (the grid is a bound)
    rows = pid_m * BM + tl.arange(0, BM)
    slot = tl.load(slots_ptr + rows)
    slot_ok = slot < n_slots
    token = (slot // TOP_K).to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    data_ptr += expert * stride_de
    scale_ptr += expert * stride_se
    n = pid_n * BN + tl.arange(0, BN)
    n_ok = n < INTER
    if SWAP:
        acc_gate = tl.zeros((BN, BM), dtype=tl.float32)
        acc_up = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc_gate = tl.zeros((BM, BN), dtype=tl.float32)
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, H, BK):
        cols = k0 + tl.arange(0, BK)
        a = tl.load(x_ptr + token[:, None] * stride_xt + cols[None, :],
                    mask=slot_ok[:, None] & (cols < H)[None, :], other=0)
        if MMA_FP32:
            a = a.to(tl.float32)
        acc_gate = accumulate_tile(acc_gate, a, data_ptr, scale_ptr, n, n_ok, k0, H, stride_dn, stride_sn,
                                   stride_sk, SCALE_ROWS, SCALE_COLS, FMT, BN, BK, PRECISION, SWAP)
        acc_up = accumulate_tile(acc_up, a, data_ptr, scale_ptr, n + INTER, n_ok, k0, H, stride_dn, stride_sn,
                                 stride_sk, SCALE_ROWS, SCALE_COLS, FMT, BN, BK, PRECISION, SWAP)
    if SWAP:
        acc_gate, acc_up = tl.trans(acc_gate), tl.trans(acc_up)
    dtype = out_ptr.dtype.element_ty
    gate = cast(acc_gate, dtype, RNE_BY_HAND).to(tl.float32)  # the matmuls' outputs are in x.dtype
    up = cast(acc_up, dtype, RNE_BY_HAND).to(tl.float32)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    silu = gate / (1.0 + tl.exp(-gate))
    if V41:  # fp32 SwiGLU, weighted before the down projection
        weight = tl.load(route_weight_ptr + slot, mask=slot_ok, other=0.0)
        hidden = silu * up * weight[:, None]
    else:  # torch's x.dtype SwiGLU: silu rounded, then the product
        hidden = cast(silu, dtype, RNE_BY_HAND).to(tl.float32) * up
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * INTER + n[None, :], cast(hidden, dtype, RNE_BY_HAND),
             mask=slot_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    hidden_ptr, slots_ptr, block_expert_ptr, rows_used_ptr, route_weight_ptr, experts_ptr, data_ptr, scale_ptr,
    out_ptr, n_slots, stride_de, stride_dn, stride_se, stride_sn, stride_sk,
    TOP_K: tl.constexpr, TOP_K_POW2: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr,
    SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, FMT: tl.constexpr, V41: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr, MMA_FP32: tl.constexpr,
    RNE_BY_HAND: tl.constexpr, SWAP: tl.constexpr,
):
    """Each slot's expert output, stored at row token * k + (its rank among the token's experts)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BM >= tl.load(rows_used_ptr):
        return
    rows = pid_m * BM + tl.arange(0, BM)
    slot = tl.load(slots_ptr + rows)
    slot_ok = slot < n_slots
    token = slot // TOP_K
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    data_ptr += expert * stride_de
    scale_ptr += expert * stride_se
    n = pid_n * BN + tl.arange(0, BN)
    n_ok = n < H
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, INTER, BK):
        cols = k0 + tl.arange(0, BK)
        a = tl.load(hidden_ptr + rows.to(tl.int64)[:, None] * INTER + cols[None, :],
                    mask=slot_ok[:, None] & (cols < INTER)[None, :], other=0)
        if MMA_FP32:
            a = a.to(tl.float32)
        acc = accumulate_tile(acc, a, data_ptr, scale_ptr, n, n_ok, k0, INTER, stride_dn, stride_sn,
                              stride_sk, SCALE_ROWS, SCALE_COLS, FMT, BN, BK, PRECISION, SWAP)
    if SWAP:
        acc = tl.trans(acc)
    dtype = hidden_ptr.dtype.element_ty
    y = cast(acc, dtype, RNE_BY_HAND).to(tl.float32)  # the down matmul's output is in x.dtype
    if not V41:  # V4 weights after the down projection
        weight = tl.load(route_weight_ptr + slot, mask=slot_ok, other=0.0)
        y = cast(y * weight[:, None], dtype, RNE_BY_HAND).to(tl.float32)
    if TOP_K == 1:
        rank = tl.zeros((BM,), dtype=tl.int32)
    else:  # experts before this one in the token's choice (ties: earlier position first)
        j = tl.arange(0, TOP_K_POW2)
        others = tl.load(experts_ptr + token.to(tl.int64)[:, None] * TOP_K + j[None, :],
                         mask=slot_ok[:, None] & (j < TOP_K)[None, :], other=-1)
        me = slot % TOP_K
        before = (j < TOP_K)[None, :] & ((others < expert) | ((others == expert) & (j[None, :] < me[:, None])))
        rank = tl.sum(before.to(tl.int32), axis=1)
    out_rows = (token * TOP_K + rank).to(tl.int64)
    tl.store(out_ptr + out_rows[:, None] * H + n[None, :], cast(y, out_ptr.dtype.element_ty, RNE_BY_HAND),
             mask=slot_ok[:, None] & n_ok[None, :])


@triton.jit
def _combine_kernel(slots_ptr, out_ptr, H: tl.constexpr, TOP_K: tl.constexpr, ROUND_EACH: tl.constexpr,
                    BH: tl.constexpr, RNE_BY_HAND: tl.constexpr):
    """out[t] = sum over r of slots[t, r] in order r = 0..k-1, rounding each partial sum if asked."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    ok = cols < H
    dtype = out_ptr.dtype.element_ty
    acc = tl.load(slots_ptr + t * TOP_K * H + cols, mask=ok, other=0.0).to(tl.float32)
    for r in tl.static_range(1, TOP_K):
        acc += tl.load(slots_ptr + (t * TOP_K + r) * H + cols, mask=ok, other=0.0).to(tl.float32)
        if ROUND_EACH:
            acc = cast(acc, dtype, RNE_BY_HAND).to(tl.float32)
    tl.store(out_ptr + t * H + cols, cast(acc, dtype, RNE_BY_HAND), mask=ok)


def _expert_stack(weight: Packed, name: str) -> dict:
    if weight.data.dim() != 3:
        raise ValueError(f"{name} must be an expert stack [E, N, K], got data {tuple(weight.data.shape)}")
    return weight_args(weight)


def moe_forward(
    x: torch.Tensor,
    route_weights: torch.Tensor,
    route_experts: torch.Tensor,
    gate_up: Packed,
    down: Packed,
    limit: float,
    v41: bool,
) -> torch.Tensor:
    """Routed experts' output [T, H] in x.dtype.

    x [T, H]; route_weights [T, k] (fp32); route_experts [T, k] (int); gate_up a stack [E, 2I, H]
    (gate rows, then up rows); down [E, H, I]. No host sync: capturable in a CUDA graph.
    """
    n_tokens, hidden_size = x.shape
    n_experts, inter = down.data.shape[0], down.in_features
    if gate_up.out_features != 2 * inter or gate_up.in_features != hidden_size or down.out_features != hidden_size:
        raise ValueError(f"expert shapes disagree: gate_up {gate_up.data.shape}, down {down.data.shape}, x {x.shape}")
    top_k = route_experts.shape[1]
    out = torch.empty(n_tokens, hidden_size, device=x.device, dtype=x.dtype)
    if n_tokens == 0:
        return out
    x = x.contiguous()
    route_experts = route_experts.contiguous()
    route_weights = route_weights.contiguous().float()
    n_slots = n_tokens * top_k
    tiles = moe_tiles(n_slots, gate_up, down)
    blocks = align_slots(route_experts, n_experts, tiles.block_m)
    w13, w2 = _expert_stack(gate_up, "gate_up"), _expert_stack(down, "down")
    common = dict(PRECISION=dot_precision(x.dtype), MMA_FP32=mma_in_fp32(x.dtype), BM=tiles.block_m,
                  V41=v41, TOP_K=top_k, H=hidden_size, INTER=inter, num_warps=tiles.num_warps,
                  num_stages=tiles.num_stages, RNE_BY_HAND=rne_by_hand(),
                  SWAP=tiles.swap)

    hidden = torch.empty(blocks.max_blocks * tiles.block_m, inter, device=x.device, dtype=x.dtype)
    grid = (blocks.max_blocks, triton.cdiv(inter, tiles.gate_up_n))
    _gate_up_kernel[grid](
        x, blocks.sorted_slots, blocks.block_expert, blocks.rows_used, route_weights, w13["data"], w13["scale"],
        hidden, n_slots, x.stride(0), w13["stride_de"], w13["stride_dn"], w13["stride_se"], w13["stride_sn"],
        w13["stride_sk"], float(limit), SCALE_ROWS=w13["scale_rows"], SCALE_COLS=w13["scale_cols"],
        FMT=w13["fmt"], BN=tiles.gate_up_n, BK=tiles.gate_up_k, **common,
    )

    slot_dtype = torch.float32 if v41 else x.dtype
    # k == 1 in x.dtype: the slot rows are the output (rank 0, row = token)
    slot_out = out if top_k == 1 and slot_dtype == x.dtype else torch.empty(
        n_slots, hidden_size, device=x.device, dtype=slot_dtype)
    grid = (blocks.max_blocks, triton.cdiv(hidden_size, tiles.down_n))
    _down_kernel[grid](
        hidden, blocks.sorted_slots, blocks.block_expert, blocks.rows_used, route_weights, route_experts,
        w2["data"], w2["scale"], slot_out, n_slots, w2["stride_de"], w2["stride_dn"], w2["stride_se"],
        w2["stride_sn"], w2["stride_sk"], TOP_K_POW2=triton.next_power_of_2(top_k),
        SCALE_ROWS=w2["scale_rows"], SCALE_COLS=w2["scale_cols"], FMT=w2["fmt"], BN=tiles.down_n,
        BK=tiles.down_k, **common,
    )
    if slot_out is out:
        return out

    block_h = min(1024, triton.next_power_of_2(hidden_size))
    _combine_kernel[(n_tokens, triton.cdiv(hidden_size, block_h))](
        slot_out, out, H=hidden_size, TOP_K=top_k, ROUND_EACH=not v41, BH=block_h, RNE_BY_HAND=rne_by_hand(), num_warps=4,
    )
    return out


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """The model's SwiGLU (engine.models.v4.moe.clamped_swiglu; not imported: the model imports this
    module, and the layout test forbids import cycles, lazy ones included)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def moe_reference(
    x: torch.Tensor,
    route_weights: torch.Tensor,
    route_experts: torch.Tensor,
    gate_up: Packed,
    down: Packed,
    limit: float,
    v41: bool,
) -> torch.Tensor:
    """Plain torch, expert by expert, on the dequantized weights, with the model's rounding points."""
    w13, w2 = gate_up.dequantize(x.dtype), down.dequantize(x.dtype)
    flat = route_experts.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    token_of = order // route_experts.shape[1]
    slot_weight = route_weights.flatten()[order].float()[:, None]
    out = torch.zeros(x.shape, device=x.device, dtype=torch.float32 if v41 else x.dtype)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tokens, weight = token_of[start : start + count], slot_weight[start : start + count]
        gate, up = F.linear(x[tokens], w13[expert]).chunk(2, dim=-1)
        if v41:
            hidden = (clamped_swiglu(gate.float(), up.float(), limit) * weight).to(x.dtype)
            out.index_add_(0, tokens, F.linear(hidden, w2[expert]).float())
        else:
            y = F.linear(clamped_swiglu(gate, up, limit), w2[expert])
            out.index_add_(0, tokens, (y * weight).to(x.dtype))
        start += count
    return out.to(x.dtype)
