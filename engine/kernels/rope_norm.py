"""Fused RMSNorm and interleaved rotary embeddings (Triton), one read and one write per tensor.

Three entry points, each matching a torch function of the model bit for bit wherever the
arithmetic is the same (the row reductions sum in another order, so norms may differ in the last
place of their fp32 scale):

  rms_norm(x, weight, eps)            RMSNorm.forward (weight) / unweighted_rms_norm (weight None)
  rope(x, cos, sin, inverse)          engine.models.v4.rope.apply_rope (and V4.1's, given cos/sin of its angles)
  norm_rope(x, weight, eps, cos, sin) apply_rope(norm(x), cos, sin), the norm's rounding to x.dtype kept

Rope rotates consecutive channel pairs of the trailing 2 * pairs channels of x [T, ..., D] and
copies the others, writing a new contiguous tensor (no torch.cat). cos / sin are [T, pairs] (any
strides, any dtype) and apply to every middle (head) axis. Grids depend on shapes only (no host
syncs), so every launch can be captured in a CUDA graph.

Kernels launch with enable_fp_fusion=False: torch runs each multiply and add as its own rounded
op, and a contracted FMA would round differently.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

TILE = 4096  # elements one program handles per step: rows x columns
MAX_ROW_BLOCK = 8192  # widest row a norm keeps in registers whole; wider rows loop over chunks
# which norm runs before the rotation (kernel globals must be constexpr)
NO_NORM, UNWEIGHTED, WEIGHTED = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _row_scale(sum_sq, inv_d, eps):
    """rsqrt(mean(x^2) + eps) per row, the mean as torch takes it (sum times 1/D)."""
    return tl.math.rsqrt(sum_sq * inv_d + eps)


@triton.jit
def _normalized(x, scale, weight, NORM: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """x (fp32) normalized as the model's torch code rounds it, in OUT_DTYPE.

    UNWEIGHTED: x * rsqrt(...).to(dtype), the product in x's dtype (exact in fp32, then one rounding).
    WEIGHTED: weight * (x * rsqrt(...)) in fp32, then one rounding.
    """
    if NORM == UNWEIGHTED:
        return (x * scale.to(OUT_DTYPE).to(tl.float32)).to(OUT_DTYPE)
    else:
        return (weight * (x * scale)).to(OUT_DTYPE)


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, n_rows, D, x_row_stride, inv_d, eps,
    NORM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, NUM_CHUNKS: tl.constexpr,
):
    out_dtype = out_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    x_rows = x_ptr + rows64[:, None] * x_row_stride
    out_rows = out_ptr + rows64[:, None] * D
    cols = tl.arange(0, BLOCK_D)
    if NUM_CHUNKS == 1:  # the whole row stays in registers: one read
        mask = row_ok[:, None] & (cols[None, :] < D)
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        scale = _row_scale(tl.sum(x * x, axis=1), inv_d, eps)[:, None]
        weight = 1.0
        if NORM == WEIGHTED:
            weight = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
        tl.store(out_rows + cols[None, :], _normalized(x, scale, weight, NORM, out_dtype), mask=mask)
    else:  # very wide rows (the hyper-connection streams): sum, then normalize chunk by chunk
        sum_sq = tl.zeros([BLOCK_ROWS, BLOCK_D], dtype=tl.float32)
        for chunk in range(NUM_CHUNKS):
            c = chunk * BLOCK_D + cols
            mask = row_ok[:, None] & (c[None, :] < D)
            x = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
            sum_sq += x * x
        scale = _row_scale(tl.sum(sum_sq, axis=1), inv_d, eps)[:, None]
        for chunk in range(NUM_CHUNKS):
            c = chunk * BLOCK_D + cols
            mask = row_ok[:, None] & (c[None, :] < D)
            x = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
            weight = 1.0
            if NORM == WEIGHTED:
                weight = tl.load(w_ptr + c, mask=c < D, other=0.0).to(tl.float32)[None, :]
            tl.store(out_rows + c[None, :], _normalized(x, scale, weight, NORM, out_dtype), mask=mask)


@triton.jit
def _rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr,
    n_rows, heads, D, pairs, x_token_stride, x_head_stride,
    cos_token_stride, cos_pair_stride, sin_token_stride, sin_pair_stride, inv_d, eps,
    NORM: tl.constexpr, INVERSE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_PAIRS: tl.constexpr,
):
    """One program: BLOCK_ROWS (token, head) rows. The untouched channels are copied (normalized
    when NORM), the trailing 2 * pairs rotated; even / odd channels load as two strided tiles (the
    second read of a row's lines hits L1)."""
    out_dtype = out_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    tokens = rows64 // heads
    x_rows = x_ptr + tokens * x_token_stride + (rows64 % heads) * x_head_stride
    out_rows = out_ptr + rows64 * D
    untouched = D - 2 * pairs

    cols = tl.arange(0, BLOCK_D)
    width = untouched
    if NORM != NO_NORM:
        width = D  # the norm needs the whole row
    mask = row_ok[:, None] & (cols[None, :] < width)
    x = tl.load(x_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = 1.0
    if NORM != NO_NORM:
        scale = _row_scale(tl.sum(x * x, axis=1), inv_d, eps)[:, None]
        weight = 1.0
        if NORM == WEIGHTED:
            weight = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
        kept = _normalized(x, scale, weight, NORM, out_dtype)
    else:
        kept = x.to(out_dtype)
    tl.store(out_rows[:, None] + cols[None, :], kept, mask=row_ok[:, None] & (cols[None, :] < untouched))

    j = tl.arange(0, BLOCK_PAIRS)
    pair_mask = row_ok[:, None] & (j[None, :] < pairs)
    even_cols = untouched + 2 * j
    even = tl.load(x_rows[:, None] + even_cols[None, :], mask=pair_mask, other=0.0).to(tl.float32)
    odd = tl.load(x_rows[:, None] + even_cols[None, :] + 1, mask=pair_mask, other=0.0).to(tl.float32)
    if NORM != NO_NORM:  # the model rounds the norm's output to x.dtype before rotating it
        w_even = 1.0
        w_odd = 1.0
        if NORM == WEIGHTED:
            w_even = tl.load(w_ptr + even_cols, mask=j < pairs, other=0.0).to(tl.float32)[None, :]
            w_odd = tl.load(w_ptr + even_cols + 1, mask=j < pairs, other=0.0).to(tl.float32)[None, :]
        even = _normalized(even, scale, w_even, NORM, out_dtype).to(tl.float32)
        odd = _normalized(odd, scale, w_odd, NORM, out_dtype).to(tl.float32)
    cos = tl.load(cos_ptr + tokens[:, None] * cos_token_stride + j[None, :] * cos_pair_stride,
                  mask=pair_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + tokens[:, None] * sin_token_stride + j[None, :] * sin_pair_stride,
                  mask=pair_mask, other=0.0).to(tl.float32)
    if INVERSE:
        sin = -sin  # exact: the same numbers as rotating by -sin
    tl.store(out_rows[:, None] + even_cols[None, :], (even * cos - odd * sin).to(out_dtype), mask=pair_mask)
    tl.store(out_rows[:, None] + even_cols[None, :] + 1, (odd * cos + even * sin).to(out_dtype), mask=pair_mask)


def _inverse_width(d: int) -> float:
    """1/D rounded once to fp32, as torch's mean scales the sum."""
    return float(np.float32(1.0) / np.float32(d))


def _warps(tile: int) -> int:
    return 4 if tile <= 4096 else 8


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMS norm over the last axis: RMSNorm's math with `weight` (fp32 compute, one rounding at
    the end), unweighted_rms_norm's with None (the scale rounded to x.dtype, then x times it)."""
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], d), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out.view(x.shape)
    block_d = max(16, triton.next_power_of_2(d))
    chunks = 1
    if block_d > MAX_ROW_BLOCK:
        block_d = TILE
        chunks = triton.cdiv(d, block_d)
    block_rows = max(1, min(TILE // block_d, triton.next_power_of_2(rows.shape[0])))
    grid = (triton.cdiv(rows.shape[0], block_rows),)
    _rms_norm_kernel[grid](
        rows, x if weight is None else weight, out, rows.shape[0], d, rows.stride(0), _inverse_width(d), eps,
        NORM=UNWEIGHTED if weight is None else WEIGHTED, BLOCK_ROWS=block_rows, BLOCK_D=block_d,
        NUM_CHUNKS=chunks, num_warps=_warps(block_rows * block_d), enable_fp_fusion=False,
    )
    return out.view(x.shape)


def _launch_rope(x, weight, eps, norm, cos, sin, inverse) -> torch.Tensor:
    if x.dim() < 2:
        raise ValueError(f"rope needs x [T, ..., D], got shape {tuple(x.shape)}")
    t, d = x.shape[0], x.shape[-1]
    pairs = cos.shape[-1]
    if 2 * pairs > d or sin.shape[-1] != pairs:
        raise ValueError(f"cos / sin of {pairs} pairs do not fit rows of {d} channels")
    cos, sin = cos.expand(t, pairs), sin.expand(t, pairs)  # [T, pairs]; a shared row broadcasts
    rows = x.reshape(t, math.prod(x.shape[1:-1]), d)  # middle axes as one head axis (a view where strides allow)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_rows = rows.shape[0] * rows.shape[1]
    if n_rows == 0 or d == 0:
        return out
    block_d = max(16, triton.next_power_of_2(d))
    block_rows = max(1, min(TILE // block_d, triton.next_power_of_2(n_rows)))
    grid = (triton.cdiv(n_rows, block_rows),)
    _rope_kernel[grid](
        rows, x if weight is None else weight, cos, sin, out,
        n_rows, rows.shape[1], d, pairs, rows.stride(0), rows.stride(1),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1), _inverse_width(d), eps,
        NORM=norm, INVERSE=inverse, BLOCK_ROWS=block_rows, BLOCK_D=block_d,
        BLOCK_PAIRS=max(16, triton.next_power_of_2(pairs)),
        num_warps=_warps(block_rows * block_d), enable_fp_fusion=False,
    )
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """apply_rope(x, cos, -sin if inverse else sin) in one pass: a new contiguous tensor of x's shape
    and dtype. x [T, ..., D]; cos / sin [T, pairs] rotate the trailing 2 * pairs channels."""
    return _launch_rope(x, None, 0.0, NO_NORM, cos, sin, inverse)


def norm_rope(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
    inverse: bool = False,
) -> torch.Tensor:
    """rope(rms_norm(x, weight, eps), cos, sin, inverse) in one pass, the norm's output rounded to
    x.dtype before the rotation as the two-step torch code rounds it. The norm is over the last
    axis (per head for x [T, H, D])."""
    return _launch_rope(x, weight, eps, UNWEIGHTED if weight is None else WEIGHTED, cos, sin, inverse)
