"""Sparse MQA attention with a per-head sink: V4's attention core, without a dense mask.

Every query token attends a set of rows of one shared key tensor (the keys double as values):
a range [lo, hi) of its sliding-window keys (optionally filtered by a per-row mask), then its
compressed entries, given as a count (rows [0, count): HCA, or CSA below the top-k) or as
indices (CSA's top-k; -1 = none). One program per (query token, block of heads): the heads are
the MMA's M dimension (all share the keys), key rows are gathered BLOCK_N at a time, and the
softmax runs online in fp32 with the sink folded in from the start (running max = sink, sum = 1:
it weighs in the denominator and adds no value, and a query with no keys gets zeros, as the
reference's softmax over [-inf..., sink] gives).

Reference: `engine.models.v4.attention.Attention._softmax_attend` with the equivalent dense mask.
Rounding follows it where it is cheap: logits are rounded to the activation dtype before and after
the scale (the reference's einsum output and its scaled copy), then fp32. What differs: the dot
products accumulate in another order, and the probabilities that multiply the values are
exp(logit - running max) rounded to the keys' dtype before the final division, rather than the
normalized probabilities rounded (flash attention's usual difference; exact in fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import interpreting

NO_ENTRIES, ENTRY_COUNT, ENTRY_INDEX = 0, 1, 2
FEW_PROGRAMS = 264  # about two per multiprocessor of an H100/H200


@triton.jit
def dot_fp32(a, b, DOT_PRECISION: tl.constexpr):
    """a @ b in fp32. The interpreter multiplies bf16 as raw integers: there, fp32 copies (bf16
    products are exact in fp32, so the result is the same); on the GPU, the operands as they are."""
    if DOT_PRECISION == "interpreter":
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _attend_rows(q, key_ptrs, key_ok, dim_ok, m, l, acc, scale,
                 ROUND_LOGITS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One block of key rows into the running (max, sum, accumulator) of every head."""
    k = tl.load(key_ptrs, mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
    s = dot_fp32(q, tl.trans(k), DOT_PRECISION)  # [BLOCK_H, BLOCK_N] fp32
    if ROUND_LOGITS:  # the reference's einsum output and its scaled copy are in the activation dtype
        s = (s.to(q.dtype).to(tl.float32) * scale).to(q.dtype).to(tl.float32)
    else:
        s = s * scale
    s = tl.where(key_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))  # m starts at the (finite) sink: never -inf
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot_fp32(p.to(k.dtype), k, DOT_PRECISION)
    return m_new, l, acc


@triton.jit
def _window_rows(q, base, mask_ptr, start, hi, stride_k, m, l, acc, scale,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_MASK: tl.constexpr, ROUND_LOGITS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Window rows [start, start + BLOCK_N) below hi, where the row mask allows."""
    rows = start + tl.arange(0, BLOCK_N)
    ok = rows < hi
    if HAS_MASK:
        ok = ok & (tl.load(mask_ptr + rows, mask=ok, other=0) != 0)
    dims = tl.arange(0, BLOCK_D)
    ptrs = base + rows.to(tl.int64)[:, None] * stride_k + dims[None, :]
    return _attend_rows(q, ptrs, ok, dims < HEAD_DIM, m, l, acc, scale, ROUND_LOGITS, DOT_PRECISION)


@triton.jit
def _counted_rows(q, base, start, count, stride_k, m, l, acc, scale,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  ROUND_LOGITS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Entry rows [start, start + BLOCK_N) below count."""
    rows = start + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    ptrs = base + rows.to(tl.int64)[:, None] * stride_k + dims[None, :]
    return _attend_rows(q, ptrs, rows < count, dims < HEAD_DIM, m, l, acc, scale, ROUND_LOGITS, DOT_PRECISION)


@triton.jit
def _sparse_attention_kernel(
    q_ptr, out_ptr, sinks_ptr, scale,
    window_ptr, window_lo_ptr, window_hi_ptr, window_mask_ptr,
    entries_ptr, entry_count_ptr, entry_idx_ptr,
    n_heads,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_wt, stride_wk, stride_mt,
    stride_et, stride_ek, stride_it,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW_MASK: tl.constexpr, ENTRY_MODE: tl.constexpr, N_IDX: tl.constexpr,
    ROUND_LOGITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < n_heads
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM

    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
    m = tl.load(sinks_ptr + heads, mask=head_ok, other=0.0).to(tl.float32)
    l = tl.full([BLOCK_H], 1.0, tl.float32)  # exp(sink - m) with m = sink
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)

    # sliding window: rows [lo, hi) of this query's window keys
    lo = tl.load(window_lo_ptr + t)
    hi = tl.load(window_hi_ptr + t)
    window_base = window_ptr + t * stride_wt
    if DOT_PRECISION != "interpreter":  # the interpreter takes no loop bounds loaded from memory
        for start in tl.range(lo, hi, BLOCK_N):
            m, l, acc = _window_rows(q, window_base, window_mask_ptr + t * stride_mt, start, hi, stride_wk,
                                     m, l, acc, scale, HEAD_DIM, BLOCK_D, BLOCK_N, HAS_WINDOW_MASK,
                                     ROUND_LOGITS, DOT_PRECISION)
    else:
        start = lo
        while start < hi:
            m, l, acc = _window_rows(q, window_base, window_mask_ptr + t * stride_mt, start, hi, stride_wk,
                                     m, l, acc, scale, HEAD_DIM, BLOCK_D, BLOCK_N, HAS_WINDOW_MASK,
                                     ROUND_LOGITS, DOT_PRECISION)
            start += BLOCK_N

    entry_base = entries_ptr + t * stride_et
    if ENTRY_MODE == 1:  # rows [0, count)
        count = tl.load(entry_count_ptr + t)
        if DOT_PRECISION != "interpreter":  # the interpreter takes no loop bounds loaded from memory
            for start in tl.range(0, count, BLOCK_N):
                m, l, acc = _counted_rows(q, entry_base, start, count, stride_ek, m, l, acc, scale,
                                          HEAD_DIM, BLOCK_D, BLOCK_N, ROUND_LOGITS, DOT_PRECISION)
        else:
            start = count * 0
            while start < count:
                m, l, acc = _counted_rows(q, entry_base, start, count, stride_ek, m, l, acc, scale,
                                          HEAD_DIM, BLOCK_D, BLOCK_N, ROUND_LOGITS, DOT_PRECISION)
                start += BLOCK_N
    if ENTRY_MODE == 2:  # the rows listed in entry_idx[t], -1 = none
        for start in range(0, N_IDX, BLOCK_N):  # constexpr bounds: a loop the compiler pipelines
            slots = start + tl.arange(0, BLOCK_N)
            rows = tl.load(entry_idx_ptr + t * stride_it + slots, mask=slots < N_IDX, other=-1)
            ptrs = entry_base + rows.to(tl.int64)[:, None] * stride_ek + tl.arange(0, BLOCK_D)[None, :]
            m, l, acc = _attend_rows(q, ptrs, rows >= 0, tl.arange(0, BLOCK_D) < HEAD_DIM, m, l, acc, scale,
                                     ROUND_LOGITS, DOT_PRECISION)

    out = acc / l[:, None]
    tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & dim_ok[None, :])


def dot_precision(dtype: torch.dtype) -> str:
    """The kernels' DOT_PRECISION: exact fp32 products for fp32 (as the torch reference), the native
    MMA for 16-bit types, or "interpreter" (Triton's CPU interpreter: loops and dots it can run)."""
    if interpreting():
        return "interpreter"
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32: the default; 16-bit operands ignore it


def _rows_last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _per_query(keys: torch.Tensor, n_queries: int) -> tuple[torch.Tensor, int, int]:
    """keys [K, D] (shared by every query) or [T, K, D] (per query) -> (keys, query stride, row stride)."""
    keys = _rows_last_contiguous(keys)
    if keys.dim() == 2:
        return keys, 0, keys.stride(0)
    if keys.shape[0] != n_queries:
        raise ValueError(f"per-query keys have {keys.shape[0]} rows of keys for {n_queries} queries")
    return keys, keys.stride(0), keys.stride(1)


def _tiles(n_queries: int, n_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_N, num_warps) for q [n_queries, n_heads, head_dim]. Measured on an H200 at
    64 heads of 512 (bf16): prefill 64 x 64 with 8 warps; decode (few queries) 32 heads a program."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    if dtype == torch.float32:  # its exact dot runs on CUDA cores: small tiles
        return 16, 32, 4
    block_h = min(64, max(16, triton.next_power_of_2(n_heads)))
    if n_queries * triton.cdiv(n_heads, block_h) < FEW_PROGRAMS:  # decode: more, smaller programs
        block_h = min(block_h, 32)
    num_warps = 8 if block_h * block_d >= 16384 else 4
    return block_h, 64, num_warps


def sparse_attention(
    q: torch.Tensor,
    window_keys: torch.Tensor,
    window_lo: torch.Tensor,
    window_hi: torch.Tensor,
    entries: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
    *,
    entry_idx: torch.Tensor | None = None,
    entry_count: torch.Tensor | None = None,
    window_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D] in q.dtype.

    window_keys [W, D] shared by every query, or [T, W, D] one set per query; query t attends rows
    [window_lo[t], window_hi[t]) of its window keys, and of those only where window_mask[t, row]
    (optional bool [T, W]). entries [E, D] or [T, E, D] (or None): query t also attends entry rows
    [0, entry_count[t]) (int [T]) or the rows entry_idx[t] lists (int [T, K], -1 = none); give one
    of the two. sinks [H]: a per-head logit in the softmax's denominator. Keys are also the values.
    No host syncs: the grid depends only on shapes (CUDA-graph safe).
    """
    n_queries, n_heads, head_dim = q.shape
    q = _rows_last_contiguous(q)
    out = torch.empty((n_queries, n_heads, head_dim), dtype=q.dtype, device=q.device)
    if n_queries == 0:
        return out
    window_keys, stride_wt, stride_wk = _per_query(window_keys, n_queries)
    window_lo, window_hi = window_lo.to(torch.int32), window_hi.to(torch.int32)
    mask_arg, stride_mt = window_keys, 0  # an unused pointer argument where there is no mask
    if window_mask is not None:
        mask_arg = window_mask.to(torch.int8).contiguous()
        stride_mt = mask_arg.stride(0)
    mode, count_arg, idx_arg, n_idx, stride_it = NO_ENTRIES, window_lo, window_lo, 0, 0
    entries_arg, stride_et, stride_ek = window_keys, 0, 0
    if entries is not None:
        if (entry_idx is None) == (entry_count is None):
            raise ValueError("entries need exactly one of entry_idx and entry_count")
        entries_arg, stride_et, stride_ek = _per_query(entries, n_queries)
        if entry_count is not None:
            mode, count_arg = ENTRY_COUNT, entry_count.to(torch.int32)
        else:
            mode, idx_arg = ENTRY_INDEX, entry_idx.to(torch.int32).contiguous()
            n_idx, stride_it = idx_arg.shape[1], idx_arg.stride(0)
    block_h, block_n, num_warps = _tiles(n_queries, n_heads, head_dim, q.dtype)
    grid = (n_queries, triton.cdiv(n_heads, block_h))
    _sparse_attention_kernel[grid](
        q, out, sinks.float().contiguous(), float(scale),
        window_keys, window_lo, window_hi, mask_arg,
        entries_arg, count_arg, idx_arg,
        n_heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        stride_wt, stride_wk, stride_mt,
        stride_et, stride_ek, stride_it,
        HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_H=block_h, BLOCK_N=block_n,
        HAS_WINDOW_MASK=window_mask is not None, ENTRY_MODE=mode, N_IDX=n_idx,
        ROUND_LOGITS=q.dtype != torch.float32, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps, num_stages=2,
    )
    return out


def masked_attention(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None, sinks: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """The reference's own interface: q [T, H, D], keys [K, D] or [T, K, D], mask [T, K] bool (or None:
    every key) -> [T, H, D]. For the decode paths, whose keys come padded with a mask."""
    n_queries, n_keys = q.shape[0], keys.shape[-2]
    lo = torch.zeros(n_queries, dtype=torch.int32, device=q.device)
    hi = torch.full((n_queries,), n_keys, dtype=torch.int32, device=q.device)
    return sparse_attention(q, keys, lo, hi, None, sinks, scale, window_mask=mask)
