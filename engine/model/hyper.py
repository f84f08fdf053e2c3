"""mHC hyper-connections: the residual is `hc_mult` streams [T, N, H] mixed around each block.

All parameters stay fp32; the mixing weights are computed in fp32 from the RMS-normed streams.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.config import ModelConfig
from engine.model.norms import unweighted_rms_norm


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Push positive [.., N, N] matrices toward doubly-stochastic (columns first, as the reference)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class HyperConnection(nn.Module):
    """Computes (post [T, N], comb [T, N, N], collapsed block input [T, H]) from the streams."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        n = config.hc_mult
        self.n = n
        self.iters = config.hc_sinkhorn_iters
        self.hc_eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * config.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = self.n
        flat = unweighted_rms_norm(streams.flatten(-2).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb_logits = comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n)
        comb = sinkhorn(torch.softmax(comb_logits, dim=-1) + self.hc_eps, self.iters, self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)
        return post, comb, collapsed


def merge_streams(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor):
    """New streams: post-weighted block output plus comb-mixed residual (out_k = sum_j comb[j, k] in_j)."""
    dtype = streams.dtype
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + mixed


class HyperHead(nn.Module):
    """Final collapse of the streams into one hidden state before the last norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        n = config.hc_mult
        self.hc_eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.empty(n, n * config.hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(-2).float(), self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)
