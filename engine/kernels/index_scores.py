"""The lightning indexer's scores in one kernel: score[t, e] = sum_h w[t, h] * ReLU(q[t, h] . k[e]) * scale.

Reference: `engine.models.v4.compressor.IndexScorer` (and `.batched`). One program per (query, block of
entries): the query's heads are the MMA's M dimension, the ReLU, the head weights and the sum over
heads stay in registers, so the [T, h, E] tensor the reference builds never exists. Entries a
query cannot see (rows >= its visible count) get -inf, and blocks it cannot see at all are never
loaded or multiplied (half of a causal prefill's work).

Rounding as the reference's: each term relu(dot) * scale, then * w, is rounded to fp32, and the sum
over heads runs in fp64 (exact in any order for such terms), then rounds to fp32. The dot products
accumulate in fp32 (bf16 products are exact in fp32) in another order than the reference's matmul.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.sparse_attention import dot_fp32, dot_precision


@triton.jit
def _index_scores_kernel(
    q_ptr, w_ptr, keys_ptr, count_ptr, out_ptr,
    n_heads, n_entries, softmax_scale,
    stride_qt, stride_qh, stride_wt, stride_wh, stride_kt, stride_ke, stride_ot,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * BLOCK_E
    entries = first + tl.arange(0, BLOCK_E)
    count = tl.load(count_ptr + t)
    visible = (entries < count) & (entries < n_entries)
    scores = tl.full([BLOCK_E], float("-inf"), tl.float32)
    if first < count:  # a scalar branch: blocks the query cannot see cost nothing
        heads = tl.arange(0, BLOCK_H)
        head_ok = heads < n_heads
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                    mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
        k = tl.load(keys_ptr + t * stride_kt + entries.to(tl.int64)[:, None] * stride_ke + dims[None, :],
                    mask=visible[:, None] & dim_ok[None, :], other=0.0)
        w = tl.load(w_ptr + t * stride_wt + heads * stride_wh, mask=head_ok, other=0.0).to(tl.float32)
        dots = dot_fp32(q, tl.trans(k), DOT_PRECISION)  # [BLOCK_H, BLOCK_E] fp32
        terms = (tl.maximum(dots, 0.0) * softmax_scale) * w[:, None]  # padded heads: w = 0
        total = tl.sum(terms.to(tl.float64), axis=0).to(tl.float32)
        scores = tl.where(visible, total, float("-inf"))
    tl.store(out_ptr + t * stride_ot + entries, scores, mask=entries < n_entries)


def index_scores(q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor, softmax_scale: float,
                 visible_count: torch.Tensor) -> torch.Tensor:
    """q [T, h, d], head_weights [T, h] (fp32), keys [E, d] shared by every query or [T, E, d] one set
    per query, visible_count [T] int (query t sees entries [0, count)) -> scores [T, E] fp32, -inf
    where not visible. The grid depends only on shapes (no host syncs: CUDA-graph safe)."""
    n_queries, n_heads, head_dim = q.shape
    n_entries = keys.shape[-2]
    out = torch.empty((n_queries, n_entries), dtype=torch.float32, device=q.device)
    if n_queries == 0 or n_entries == 0:
        return out
    if keys.dtype != q.dtype:  # the reference multiplies both in fp32: a common dtype loses nothing
        q, keys = q.float(), keys.float()
    q = q if q.stride(-1) == 1 else q.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    if keys.dim() == 2:
        stride_kt, stride_ke = 0, keys.stride(0)
    else:
        if keys.shape[0] != n_queries:
            raise ValueError(f"per-query keys have {keys.shape[0]} rows of keys for {n_queries} queries")
        stride_kt, stride_ke = keys.stride(0), keys.stride(1)
    block_h = max(16, triton.next_power_of_2(n_heads))
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_e = 32 if block_h * block_d >= 16384 else 64
    grid = (n_queries, triton.cdiv(n_entries, block_e))
    _index_scores_kernel[grid](
        q, head_weights, keys, visible_count.to(torch.int32), out,
        n_heads, n_entries, float(softmax_scale),
        q.stride(0), q.stride(1), head_weights.stride(0), head_weights.stride(1), stride_kt, stride_ke, out.stride(0),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_E=block_e,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=4,
    )
    return out
