"""A compressor's tail: the tokens not yet pooled into a compressed entry (and, for V4's CSA, the
overlap half of the last full window). Kept apart from state.py: the model contract names it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PoolerTail:
    pending_kv: torch.Tensor  # [p < ratio, width] projected kv of tokens after the last full window
    pending_gate: torch.Tensor  # [p, width] raw gate logits of those tokens
    overlap_kv: torch.Tensor | None = None  # [ratio, head_dim] CSA: first ("Ca") half of the last full window
    overlap_gate: torch.Tensor | None = None  # [ratio, head_dim] raw gate logits of that half

    def clone(self) -> "PoolerTail":
        return PoolerTail(*(None if t is None else t.clone() for t in tail_tensors(self)))


def empty_tail(head_dim: int, overlap: bool, device, dtype) -> PoolerTail:
    width = 2 * head_dim if overlap else head_dim
    empty = torch.empty(0, width, device=device, dtype=dtype)
    return PoolerTail(pending_kv=empty, pending_gate=empty.clone())


def tail_tensors(tail: PoolerTail) -> tuple:
    return (tail.pending_kv, tail.pending_gate, tail.overlap_kv, tail.overlap_gate)
