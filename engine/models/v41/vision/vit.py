"""The V4.1 vision transformer (V4's, unchanged): patch embedding, pre-norm blocks, final norm.

Each image attends over its own patches only (full, bidirectional attention), with a 2D rotary
embedding: of each head's dims, the first half rotate with the patch's row and the second half with
its column (half-split pairs: dim j with dim j + head_dim/2, each half using head_dim/4 frequencies).
Rows of several images are packed along one axis; everything but attention runs on the pack at once.
Module names are the released checkpoint's (`vision.patch_embed.proj`, `vision.blocks.N.attn.wqkv`, ...).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.common.norms import RMSNorm
from engine.models.v41.config import V41VisionConfig

NORM_EPS = 1e-6  # the reference's vision RMSNorm default; the config has no field for it


def rotary_tables(grids: Sequence[tuple[int, int]], head_dim: int, theta: float,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [sum(h*w), 1, head_dim/2] (fp32) for the packed patches of images of (rows, cols) patches."""
    quarter = head_dim // 4
    inv_freq = 1.0 / theta ** (torch.arange(0, 2 * quarter, 2, dtype=torch.float32, device=device) / (2 * quarter))
    positions = []
    for rows, cols in grids:
        row = torch.arange(rows, device=device).repeat_interleave(cols)
        col = torch.arange(cols, device=device).repeat(rows)
        positions.append(torch.stack([row, col], dim=-1))
    angles = (torch.cat(positions).float()[:, :, None] * inv_freq).flatten(1)  # [N, row freqs | col freqs]
    return angles.cos()[:, None], angles.sin()[:, None]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, head_dim]: half-split rotation computed in fp32."""
    first, second = x.float().chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).to(x.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, config: V41VisionConfig):
        super().__init__()
        self.proj = nn.Linear(3 * config.patch_size ** 2, config.hidden_size)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[N, 3, p, p] -> [N, dim]."""
        return self.proj(patches.flatten(1))


class Attention(nn.Module):
    def __init__(self, config: V41VisionConfig):
        super().__init__()
        self.heads, self.head_dim = config.num_heads, config.head_dim
        self.wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.wo = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """x [N, dim] packed over images of `lengths` patches; each attends to its own patches."""
        q, k, v = (t.view(x.shape[0], self.heads, self.head_dim) for t in self.wqkv(x).chunk(3, dim=-1))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = torch.empty_like(q)
        start = 0
        for length in lengths:  # unmasked per image: any SDPA kernel applies and no padding is computed
            rows = slice(start, start + length)
            out[rows] = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1), k[rows].transpose(0, 1), v[rows].transpose(0, 1)).transpose(0, 1)
            start += length
        return self.wo(out.flatten(1))


class MLP(nn.Module):
    """SwiGLU: w1 gives [gate | up], bias-free."""

    def __init__(self, config: V41VisionConfig):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: V41VisionConfig):
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, NORM_EPS)
        self.attn = Attention(config)
        self.norm2 = RMSNorm(config.hidden_size, NORM_EPS)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    def __init__(self, config: V41VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, NORM_EPS)

    def forward(self, patches: torch.Tensor, grids: Sequence[tuple[int, int]]) -> torch.Tensor:
        """patches [sum(h*w), 3, p, p] of images with (h, w) patch grids, packed in order -> [sum(h*w), dim]."""
        lengths = [rows * cols for rows, cols in grids]
        if patches.shape[0] != sum(lengths):
            raise ValueError(f"{patches.shape[0]} patches for grids {list(grids)} ({sum(lengths)} patches)")
        x = self.patch_embed(patches)
        cos, sin = rotary_tables(grids, self.config.head_dim, self.config.rope_theta, x.device)
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        return self.norm(x)
