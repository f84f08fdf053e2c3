"""Engram: an n-gram memory read gated into every hyper-connection stream (V4.1 layers 1 and 14).

Each token reads `rows_per_token` table rows (see `engram_hash`), concatenated into one vector.
`wkv` projects it to one key per stream plus one value shared by the streams. Stream s gets
    gate_s = sigmoid(signed_sqrt(<rms(h_s) * q_weight_s * k_weight_s, rms(key_s)> / sqrt(hidden)))
    h_s   += gate_s * value
with rms(x) = x / sqrt(mean(x^2) + eps) (no weight), signed_sqrt(x) = sign(x) sqrt(max(|x|, 1e-6)).
The gate is 0 on image and padding tokens, which pass through unchanged. This runs on the streams
before the block's attention hyper-connection.

Checkpoint names under `layers.{i}.engram.`: `wkv.weight` (FP8, 32x32 scales: dequantized by the
loader like other linears), `q_weight`, `k_weight` [hc_mult, hidden], and the table
`embed.weight` (FP8) + `embed.scale` (e8m0 [rows, head_dim / 32]), which go to `load_table`: the
table is host memory, not a parameter, so `.to(device)` and `state_dict()` leave it alone.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.v41.config import V41Config
from engine.models.v41.engram_table import EngramTable

TABLE_NAMES = ("embed.weight", "embed.scale")  # checkpoint names (under `engram.`) that feed load_table
_GATE_FLOOR = 1e-6


class Engram(nn.Module):
    def __init__(self, config: V41Config, layer: int, dtype: torch.dtype | None = None):
        super().__init__()
        if layer not in config.engram_layer_ids:
            raise ValueError(f"layer {layer} is not an Engram layer {config.engram_layer_ids}")
        self.layer = layer
        self.hash_index = config.engram_layer_ids.index(layer)  # this layer's slot in the hasher's output
        self.hidden_size, self.hc_mult, self.eps = config.hidden_size, config.hc_mult, config.rms_norm_eps
        self.rows_per_token = (config.engram_max_ngram_size - 1) * config.engram_n_heads
        self.table = EngramTable(config.engram_num_embeddings[self.hash_index], config.engram_head_dim)
        self.wkv = nn.Linear(self.rows_per_token * config.engram_head_dim, self.hidden_size * (self.hc_mult + 1),
                             bias=False, dtype=dtype)
        self.q_weight = nn.Parameter(torch.ones(self.hc_mult, self.hidden_size, dtype=dtype))
        self.k_weight = nn.Parameter(torch.ones(self.hc_mult, self.hidden_size, dtype=dtype))

    def load_table(self, values: torch.Tensor, scales: torch.Tensor | None = None) -> None:
        """values: `engram.embed.weight` (FP8 [rows, head_dim], or floating with scales None);
        scales: `engram.embed.scale` (e8m0 [rows, head_dim / 32])."""
        self.table.load(values, scales)

    def read_rows(self, hash_rows: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
        """The memory vectors of hash_rows [T, rows_per_token]: [T, rows_per_token * head_dim] in the
        projection's dtype. Separate from forward so a caller can fetch them ahead (outside a graph)."""
        weight = self.wkv.weight
        return self.table.read(hash_rows, weight.device if device is None else device, weight.dtype).flatten(1)

    def forward(self, streams: torch.Tensor, hash_rows: torch.Tensor, token_mask: torch.Tensor | None = None,
                memory: torch.Tensor | None = None) -> torch.Tensor:
        """streams [T, hc_mult, hidden]; hash_rows [T, rows_per_token] (this layer's slice of the
        hasher's output); token_mask [T] bool, False on image/padding tokens (gate 0); memory: the
        `read_rows` result if already fetched. Returns new streams in the input dtype."""
        tokens = streams.shape[0]
        if streams.shape[1:] != (self.hc_mult, self.hidden_size):
            raise ValueError(f"streams must be [T, {self.hc_mult}, {self.hidden_size}], got {tuple(streams.shape)}")
        if hash_rows.shape != (tokens, self.rows_per_token):
            raise ValueError(f"hash_rows must be [{tokens}, {self.rows_per_token}], got {tuple(hash_rows.shape)}")
        if memory is None:
            memory = self.read_rows(hash_rows, streams.device)
        key, value = self.wkv(memory.to(self.wkv.weight.dtype)).float().split(
            (self.hc_mult * self.hidden_size, self.hidden_size), dim=-1)
        key = key.view(tokens, self.hc_mult, self.hidden_size)
        hidden = streams.float()
        inv_rms = torch.rsqrt(hidden.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        weights = self.q_weight.float() * self.k_weight.float()
        score = (hidden * weights * key).sum(-1) * inv_rms / self.hidden_size ** 0.5
        gate = torch.sigmoid(torch.copysign(score.abs().clamp_min(_GATE_FLOOR).sqrt(), score))
        if token_mask is not None:
            if token_mask.shape != (tokens,):
                raise ValueError(f"token_mask must be [{tokens}], got {tuple(token_mask.shape)}")
            gate = gate.masked_fill(~token_mask.to(gate.device, torch.bool)[:, None], 0.0)
        return (hidden + gate[..., None] * value[:, None, :]).to(streams.dtype)
