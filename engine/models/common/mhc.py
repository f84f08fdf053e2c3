"""The mHC stream-mixing matrix: a row softmax pushed toward doubly-stochastic by Sinkhorn steps."""

from __future__ import annotations

import torch


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Push positive [.., N, N] matrices toward doubly-stochastic (columns first, as the reference)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def mix_matrix(comb_logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Softmax rows of the [.., N, N] logits, then Sinkhorn: the stream-mixing matrix."""
    return sinkhorn(torch.softmax(comb_logits, dim=-1) + eps, iters, eps)
