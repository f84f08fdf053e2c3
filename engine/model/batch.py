"""The packed tokens of one forward pass over several sequences."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.model.state import SequenceKV


@dataclass(slots=True)
class ForwardBatch:
    """Sequence i owns tokens spans[i] = (start, end) of the packed tensors; its state is states[i].

    captures[i] (optional): absolute positions inside (first, last + 1] of sequence i's chunk at
    which every layer asks the state to `capture` its window and tails (block boundaries).
    """

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] absolute positions
    spans: list[tuple[int, int]]
    states: list[SequenceKV]
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # flavour ("main" / "compress") -> cos, sin [T, rope_dim // 2]
    captures: list[tuple[int, ...]] = field(default_factory=list)
