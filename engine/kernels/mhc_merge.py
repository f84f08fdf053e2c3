"""Fused Triton kernels for mHC hyper-connections: collapsing the streams and merging a block's output.

`hc_merge` is one elementwise pass (streams and block output read once) in place of V4's per-token
[N x N] x [N x H] bmm (a small wmma kernel far from the memory rate in prefill) plus the post term,
or V4.1's broadcast-and-sum. Rounding follows each reference: V4 (`merge_streams`) rounds comb and
post to the streams dtype, the mixed term and the post term each to that dtype, then adds; V4.1
(`expand`) stays in fp32 and casts once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rounded_to(x, dtype: tl.constexpr):
    """fp32 x rounded to `dtype` (nearest even) and back. For bf16 with integer ops: a plain
    `.to(bf16).to(fp32)` pair may be folded away by the compiler (and the interpreter truncates)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # a NaN stays NaN
    return x.to(dtype).to(tl.float32)


@triton.jit
def _collapse_kernel(streams_ptr, pre_ptr, out_ptr, H, N: tl.constexpr, NP: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    rows = tl.arange(0, NP)
    row_ok = rows < N
    x = tl.load(streams_ptr + t * N * H + rows[:, None] * H + h[None, :],
                mask=row_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
    pre = tl.load(pre_ptr + t * N + rows, mask=row_ok, other=0.0).to(tl.float32)
    # (pre * streams) promotes to fp32 in both references; the sum over streams is fp32 too
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + t * H + h, rounded_to(tl.sum(pre[:, None] * x, axis=0), dtype).to(dtype), mask=h_ok)


@triton.jit
def _merge_kernel(streams_ptr, block_ptr, post_ptr, comb_ptr, out_ptr, H, block_stride,
                  N: tl.constexpr, NP: tl.constexpr, BLOCK_H: tl.constexpr, ROUND_V4: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    k = tl.arange(0, NP)
    k_ok = k < N
    dtype = out_ptr.dtype.element_ty
    post = tl.load(post_ptr + t * N + k, mask=k_ok, other=0.0).to(tl.float32)
    block = tl.load(block_ptr + t * block_stride + h, mask=h_ok, other=0.0).to(tl.float32)
    mixed = tl.zeros([NP, BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(N):
        # out[k] += comb[j, k] * streams[j]: row j of comb against stream j, read once
        stream = tl.load(streams_ptr + t * N * H + j * H + h, mask=h_ok, other=0.0).to(tl.float32)
        coeff = tl.load(comb_ptr + t * N * N + j * N + k, mask=k_ok, other=0.0).to(tl.float32)
        if ROUND_V4:
            coeff = rounded_to(coeff, dtype)
        mixed += coeff[:, None] * stream[None, :]
    if ROUND_V4:
        update = rounded_to(rounded_to(post, dtype)[:, None] * block[None, :], dtype)
        out = update + rounded_to(mixed, dtype)
    else:
        out = post[:, None] * block[None, :] + mixed
    # rounded by hand first: exact on every backend (the interpreter truncates a plain cast)
    out_offs = t * N * H + k[:, None] * H + h[None, :]
    tl.store(out_ptr + out_offs, rounded_to(out, dtype).to(dtype), mask=k_ok[:, None] & h_ok[None, :])


def _block_h(t: int, h: int) -> int:
    # few tokens (decode): narrow tiles, so that more programs share the work
    return min(triton.next_power_of_2(h), 256 if t <= 16 else 1024)


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """streams [T, N, H] weighted by pre [T, N] -> [T, H] in streams.dtype, summed in fp32."""
    streams, pre = streams.contiguous(), pre.contiguous()
    t, n, h = streams.shape
    out = torch.empty(t, h, device=streams.device, dtype=streams.dtype)
    if t == 0:
        return out
    block_h = _block_h(t, h)
    np_ = triton.next_power_of_2(n)
    _collapse_kernel[(t, triton.cdiv(h, block_h))](
        streams, pre, out, h, N=n, NP=np_, BLOCK_H=block_h, num_warps=4 if np_ * block_h >= 1024 else 2,
    )
    return out


def hc_merge(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
             v41: bool) -> torch.Tensor:
    """out[t, k] = post[t, k] * block_out[t] + sum_j comb[t, j, k] * streams[t, j] -> [T, N, H].

    V4 (`merge_streams`): in streams.dtype's rounding, returns streams.dtype. V4.1 (`expand`): fp32
    throughout, returns block_out.dtype."""
    streams, post, comb = streams.contiguous(), post.contiguous(), comb.contiguous()
    if block_out.stride(-1) != 1:
        block_out = block_out.contiguous()
    t, n, h = streams.shape
    out = torch.empty(t, n, h, device=streams.device, dtype=block_out.dtype if v41 else streams.dtype)
    if t == 0:
        return out
    block_h = _block_h(t, h)
    np_ = triton.next_power_of_2(n)
    _merge_kernel[(t, triton.cdiv(h, block_h))](
        streams, block_out, post, comb, out, h, block_out.stride(0),
        N=n, NP=np_, BLOCK_H=block_h, ROUND_V4=not v41, num_warps=4 if np_ * block_h >= 1024 else 2,
    )
    return out
