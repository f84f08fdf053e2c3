"""The frozen V4.1 indexer: which compressed entries each query attends.

KV sources own the keys: their compressor's latent through `wk`, RMSNorm, RoPE and mxfp4
rounding (one key per compressed entry; no pooler of its own, unlike V4). Index sources (the KV
sources and the "reindex" layers) score every visible entry with their own queries:

    score[t, s] = sum_h round(w[t, h] * ReLU(round(q[t, h] . k[s]))),  w = weights_proj(x) / sqrt(d * heads)

where `round` is the activation dtype (BF16 in the release; the sum stays exact here, in fp64,
so a score does not depend on how many queries or entries run together), and keep the top-k.
The candidate source first keeps the best `candidate_topk_blocks` blocks of
`candidate_block_size` entries (always the block of the newest visible entry); later layers that
reindex choose their top-k inside those candidate blocks.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.common.norms import RMSNorm
from engine.models.v41.cache_rounding import INDEX_QK, round_cache
from engine.models.v41.config import V41Config
from engine.models.v41.rope import apply_rope


class Indexer(nn.Module):
    def __init__(self, config: V41Config, owns_keys: bool):
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.top_k = config.index_topk
        self.weight_scale = config.index_head_dim**-0.5 * config.index_n_heads**-0.5
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        if owns_keys:
            self.wk = nn.Linear(config.head_dim, self.head_dim, bias=False)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.requires_grad_(False)

    def keys(self, latent: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """Unrotated compressed latents [n, head_dim] -> index keys [n, index_head_dim]."""
        return round_cache(apply_rope(self.k_norm(self.wk(latent)), angles), INDEX_QK)

    def queries(self, query_latent: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """[T, q_lora_rank] -> [T, heads, index_head_dim]."""
        q = self.wq_b(query_latent).unflatten(-1, (self.n_heads, self.head_dim))
        return round_cache(apply_rope(q, angles), INDEX_QK)

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        return self.weights_proj(x) * self.weight_scale

    def scores(self, q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """q [T, h, d], head_weights [T, h], keys [E, d] -> scores [T, E] (fp32)."""
        dots = torch.matmul(q, keys.t())  # [T, h, E] in the activation dtype
        terms = dots.relu() * head_weights.unsqueeze(-1)
        return terms.double().sum(dim=1).to(q.dtype).float()


def top_k_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[T, E] scores (-inf: not a candidate) -> bool mask of the k best others per row
    (equal scores: the lower index first, whatever the width)."""
    eligible = scores > float("-inf")
    if scores.shape[-1] <= k:
        return eligible
    best = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    return torch.zeros_like(eligible).scatter_(1, best, True) & eligible


def candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, top_blocks: int, block: int) -> torch.Tensor:
    """[T, E] masked scores, visible [T] entry counts -> bool [T, E]: entries in each row's best
    `top_blocks` blocks (a block scores its best entry), always including the newest visible block."""
    width = scores.shape[-1]
    padded = torch.nn.functional.pad(scores, (0, -width % block), value=float("-inf"))
    block_scores = padded.unflatten(-1, (-1, block)).amax(dim=-1)
    newest = torch.div(visible - 1, block, rounding_mode="floor")
    block_ids = torch.arange(block_scores.shape[-1], device=scores.device)
    block_scores = block_scores.masked_fill(block_ids[None, :] == newest[:, None], float("inf"))
    keep = top_k_mask(block_scores, top_blocks)
    return keep.repeat_interleave(block, dim=-1)[:, :width]
