"""Pieces of attention both families compute the same way: which window keys a query sees, and the
softmax with one extra per-head "sink" logit that lets a head attend to nothing."""

from __future__ import annotations

import torch


def window_mask(positions: torch.Tensor, key_lo: int, last: int, window: int) -> torch.Tensor:
    """[queries, keys]: the query at position p sees window keys at positions [p - window + 1, p]
    among the keys at positions [key_lo, last]."""
    key_positions = torch.arange(key_lo, last + 1, device=positions.device)
    distance = positions[:, None] - key_positions[None, :]
    return (distance >= 0) & (distance < window)


def sink_softmax(logits: torch.Tensor, mask: torch.Tensor | None, sinks: torch.Tensor) -> torch.Tensor:
    """fp32 logits [q, heads, keys] -> fp32 probabilities over the allowed keys (mask [q, keys], None:
    all), normalised together with one sink logit per head whose share is dropped."""
    if mask is not None:
        logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    sinks = sinks.float().view(1, -1, 1).expand(logits.shape[0], -1, 1)
    return torch.cat([logits, sinks], dim=-1).softmax(dim=-1, dtype=torch.float32)[..., :-1]
