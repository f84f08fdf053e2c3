"""The packed tokens of one forward pass over several sequences."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.state import SequenceState


@dataclass(slots=True)
class ForwardBatch:
    """Sequence i owns tokens spans[i] = (start, end) of the packed tensors; its state is states[i]."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] absolute positions
    spans: list[tuple[int, int]]
    states: list[SequenceState]
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # flavour ("main" / "compress") -> cos, sin [T, rope_dim // 2]
