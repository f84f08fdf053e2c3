"""The packed tokens of one forward pass over several sequences."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.models.spec import SequenceKV


@dataclass(slots=True)
class ForwardBatch:
    """Sequence i owns tokens spans[i] = (start, end) of the packed tensors; its state is states[i].

    captures[i] (optional): absolute positions inside (first, last + 1] of sequence i's chunk at
    which every layer asks the state to `capture` its window and tails (block boundaries).
    decode (optional): a batched view (the states' `decode_view_type`) of the leading sequences
    that add one token each (decodes come first in a step); attention runs those batched.
    """

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] absolute positions
    spans: list[tuple[int, int]]
    states: list[SequenceKV]
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # flavour ("main" / "compress") -> cos, sin [T, rope_dim // 2]
    captures: list[tuple[int, ...]] = field(default_factory=list)
    decode: Any = None  # engine.kv.decode_view.DecodeView over the first decode.num_rows tokens
