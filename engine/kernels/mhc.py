"""Fused Triton kernels for mHC hyper-connections (V4 and V4.1): statistics and mixing coefficients.

Per site the torch path runs ~150 tiny kernels (the 20-iteration Sinkhorn alone is ~120); here it is
  1. `hc_stream_stats`: one pass over the streams -> fp32 flat copy for the projection (only when
     the streams are not fp32), the inverse RMS per token, and optionally a collapse with a known `pre`;
  2. F.linear (cuBLAS) of the flat streams with the fp32 projection;
  3. `hc_coefficients`: inverse-RMS scale, affine, sigmoids, row softmax and the whole Sinkhorn in
     registers, BLOCK_T tokens per program;
then `hc_collapse` / `hc_merge` (engine.kernels.mhc_merge). No host syncs, grids depend only on shapes
(decode runs inside CUDA graphs).

V4 normalises the streams before the projection (linear(x * r)); here it is linear(x) * r, as V4.1
does: the same up to fp32 rounding, well inside the projection's own accumulation error, and it
saves writing a normalised copy of the streams.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.kernels.mhc_merge import rounded_to, hc_collapse

# stands in for -inf on padded softmax entries (a padded row stays finite: exp(0) = 1, zeroed after)
_NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _stream_stats_kernel(streams_ptr, flat_ptr, inv_rms_ptr, pre_ptr, collapsed_ptr, norm_eps,
                         H: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, BLOCK_H: tl.constexpr,
                         WRITE_FLAT: tl.constexpr, COLLAPSE: tl.constexpr):
    # one program per token: the RMS needs the whole [N, H] row, so no cross-program reduction.
    # H is constexpr (one model, one width): the loop bound is static
    t = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, NP)
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_H)
    row_base = t * N * H
    if COLLAPSE:
        pre = tl.load(pre_ptr + t * N + rows, mask=row_ok, other=0.0).to(tl.float32)
    squares = tl.zeros([NP, BLOCK_H], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + cols
        h_ok = h < H
        mask = row_ok[:, None] & h_ok[None, :]
        offs = row_base + rows[:, None] * H + h[None, :]
        x = tl.load(streams_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        squares += x * x
        if WRITE_FLAT:
            tl.store(flat_ptr + offs, x, mask=mask)
        if COLLAPSE:
            dtype = collapsed_ptr.dtype.element_ty
            summed = rounded_to(tl.sum(pre[:, None] * x, axis=0), dtype)
            tl.store(collapsed_ptr + t * H + h, summed.to(dtype), mask=h_ok)
    total = tl.sum(tl.sum(squares, axis=1), axis=0)
    tl.store(inv_rms_ptr + t, tl.rsqrt(total / (N * H) + norm_eps))


@triton.jit
def _affine(m, s, b, FMA: tl.constexpr):
    # V4.1's addcmul(base, mixes, scales) is one fused multiply-add; V4 writes mixes * s + b
    if FMA:
        return tl.fma(m, s, b)
    return m * s + b


@triton.jit
def _coefficients_kernel(mixes_ptr, row_scale_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr,
                         T, hc_eps,
                         N: tl.constexpr, NP: tl.constexpr, W: tl.constexpr, ITERS: tl.constexpr, BLOCK_T: tl.constexpr,
                         HAS_ROW_SCALE: tl.constexpr, FMA: tl.constexpr, PRE_ONLY: tl.constexpr):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tok < T
    row = tok.to(tl.int64) * W
    k = tl.arange(0, NP)
    k_ok = k < N
    vec_mask = tok_ok[:, None] & k_ok[None, :]
    vec_offs = row[:, None] + k[None, :]
    out_offs = tok.to(tl.int64)[:, None] * N + k[None, :]
    if HAS_ROW_SCALE:
        r = tl.load(row_scale_ptr + tok, mask=tok_ok, other=0.0)

    m = tl.load(mixes_ptr + vec_offs, mask=vec_mask, other=0.0)
    if HAS_ROW_SCALE:
        m = m * r[:, None]
    b = tl.load(base_ptr + k, mask=k_ok, other=0.0)
    pre = tl.sigmoid(_affine(m, tl.load(scale_ptr), b[None, :], FMA)) + hc_eps
    tl.store(pre_ptr + out_offs, pre, mask=vec_mask)
    if not PRE_ONLY:
        m = tl.load(mixes_ptr + vec_offs + N, mask=vec_mask, other=0.0)
        if HAS_ROW_SCALE:
            m = m * r[:, None]
        b = tl.load(base_ptr + N + k, mask=k_ok, other=0.0)
        post = 2 * tl.sigmoid(_affine(m, tl.load(scale_ptr + 1), b[None, :], FMA))
        tl.store(post_ptr + out_offs, post, mask=vec_mask)

        # comb: [BLOCK_T, NP(j: in), NP(k: out)]; softmax over k, then Sinkhorn
        j = tl.arange(0, NP)
        entry = j[:, None] * N + k[None, :]
        entry_ok = (j < N)[:, None] & k_ok[None, :]
        mask3 = tok_ok[:, None, None] & entry_ok[None, :, :]
        m = tl.load(mixes_ptr + row[:, None, None] + 2 * N + entry[None, :, :], mask=mask3, other=0.0)
        if HAS_ROW_SCALE:
            m = m * r[:, None, None]
        b = tl.load(base_ptr + 2 * N + entry, mask=entry_ok, other=0.0)
        logits = _affine(m, tl.load(scale_ptr + 2), b[None, :, :], FMA)
        logits = tl.where(entry_ok[None, :, :], logits, _NEG_BIG)
        e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
        comb = e / tl.sum(e, axis=2)[:, :, None]
        comb = tl.where(entry_ok[None, :, :], comb + hc_eps, 0.0)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
        for _ in range(ITERS - 1):
            comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
            comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
        comb_offs = tok.to(tl.int64)[:, None, None] * (N * N) + entry[None, :, :]
        tl.store(comb_ptr + comb_offs, comb, mask=mask3)


def hc_stream_stats(streams: torch.Tensor, norm_eps: float, collapse_pre: torch.Tensor | None = None):
    """streams [T, N, H] -> (flat fp32 [T, N*H] (a view when already fp32), inverse RMS [T] fp32,
    collapsed [T, H] in streams.dtype with `collapse_pre` [T, N], or None)."""
    streams = streams.contiguous()
    t, n, h = streams.shape
    write_flat = streams.dtype != torch.float32
    flat = torch.empty(t, n * h, device=streams.device, dtype=torch.float32) if write_flat else streams.view(t, n * h)
    inv_rms = torch.empty(t, device=streams.device, dtype=torch.float32)
    collapsed = None
    if collapse_pre is not None:
        collapse_pre = collapse_pre.contiguous()
        collapsed = torch.empty(t, h, device=streams.device, dtype=streams.dtype)
    if t == 0:
        return flat, inv_rms, collapsed
    np_ = triton.next_power_of_2(n)
    block_h = min(triton.next_power_of_2(h), max(4096 // np_, 16))
    _stream_stats_kernel[(t,)](
        streams, flat, inv_rms, collapse_pre if collapse_pre is not None else inv_rms,
        collapsed if collapsed is not None else inv_rms, norm_eps,
        H=h, N=n, NP=np_, BLOCK_H=block_h, WRITE_FLAT=write_flat, COLLAPSE=collapse_pre is not None,
        num_warps=8 if np_ * block_h >= 4096 else 4,
    )
    return flat, inv_rms, collapsed


def _launch_coefficients(mixes, scale, base, n, iters, eps, v41, row_scale, pre_only):
    mixes = mixes.float().contiguous()
    t, width = mixes.shape
    pre = torch.empty(t, n, device=mixes.device, dtype=torch.float32)
    post = torch.empty(0 if pre_only else t, n, device=mixes.device, dtype=torch.float32)
    comb = torch.empty(0 if pre_only else t, n, n, device=mixes.device, dtype=torch.float32)
    if t == 0:
        return pre, post, comb
    block_t = min(64, triton.next_power_of_2(t))
    _coefficients_kernel[(triton.cdiv(t, block_t),)](
        mixes, row_scale.float().contiguous() if row_scale is not None else mixes,
        scale.float().contiguous(), base.float().contiguous(), pre, post, comb, t, eps,
        N=n, NP=triton.next_power_of_2(n), W=width, ITERS=iters, BLOCK_T=block_t,
        HAS_ROW_SCALE=row_scale is not None, FMA=v41, PRE_ONLY=pre_only,
        num_warps=4 if block_t >= 32 else 1,
    )
    return pre, post, comb


def hc_coefficients(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int, iters: int,
                    eps: float, v41: bool, row_scale: torch.Tensor | None = None):
    """mixes [T, (2+N)*N] (times `row_scale` [T] when given), scale [3], base [(2+N)*N] ->
    (pre [T, N], post [T, N], comb [T, N, N]), all fp32."""
    if mixes.shape[-1] != (2 + n) * n:
        raise ValueError(f"mixes must be [T, {(2 + n) * n}], got {tuple(mixes.shape)}")
    return _launch_coefficients(mixes, scale, base, n, iters, eps, v41, row_scale, pre_only=False)


def hc_head_pre(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, eps: float,
                row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The final head's pre [T, N] = sigmoid(mixes * row_scale * scale[0] + base) + eps."""
    return _launch_coefficients(mixes, scale, base, mixes.shape[-1], 1, eps, False, row_scale, pre_only=True)[0]


def hc_v4_site(streams, fn, base, scale, n: int, iters: int, hc_eps: float, norm_eps: float):
    """V4 `HyperConnection.forward`: streams [T, N, H] -> (post [T, N], comb [T, N, N], collapsed [T, H])."""
    flat, inv_rms, _ = hc_stream_stats(streams, norm_eps)
    mixes = F.linear(flat, fn.float())
    pre, post, comb = hc_coefficients(mixes, scale, base, n, iters, hc_eps, v41=False, row_scale=inv_rms)
    return post, comb, hc_collapse(streams, pre)


def hc_v4_head(streams, fn, base, scale, hc_eps: float, norm_eps: float) -> torch.Tensor:
    """V4 `HyperHead.forward`: streams [T, N, H] -> the collapsed hidden state [T, H]."""
    flat, inv_rms, _ = hc_stream_stats(streams, norm_eps)
    pre = hc_head_pre(F.linear(flat, fn.float()), scale, base, hc_eps, row_scale=inv_rms)
    return hc_collapse(streams, pre)


def hc_v41_site(streams, fn, base, scale, n: int, iters: int, hc_eps: float, norm_eps: float,
                collapse_pre: torch.Tensor | None = None):
    """V4.1 `predict_mix` (and, with `collapse_pre`, the site's collapse in the same pass over the
    streams) -> (pre, post, comb, collapsed [T, H] or None)."""
    flat, inv_rms, collapsed = hc_stream_stats(streams, norm_eps, collapse_pre)
    pre, post, comb = hc_coefficients(F.linear(flat, fn.float()), scale, base, n, iters, hc_eps,
                                      v41=True, row_scale=inv_rms)
    return pre, post, comb, collapsed
