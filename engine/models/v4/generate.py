"""Greedy decoding on one sequence's state: prefill in chunks, then one token per step."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.models.common.state import SequenceState
from engine.models.v4.model import DeepseekV4


def prefill(
    model: DeepseekV4, state: SequenceState, prompt: torch.Tensor, chunk_sizes: Iterable[int] = ()
) -> torch.Tensor:
    """Feed `prompt` in pieces of the given sizes (cycled; the rest as one piece). Returns last logits [vocab]."""
    sizes = list(chunk_sizes)
    start, i, logits = 0, 0, None
    while start < prompt.numel():
        size = sizes[i % len(sizes)] if sizes else prompt.numel()
        logits = model([prompt[start : start + size]], [state])[0]
        start += size
        i += 1
    if logits is None:
        raise ValueError("empty prompt")
    return logits


def decode_greedy(model: DeepseekV4, state: SequenceState, logits: torch.Tensor, max_new_tokens: int) -> list[int]:
    """Continue from the last logits for `max_new_tokens` argmax steps (no stop token)."""
    tokens = []
    for step in range(max_new_tokens):
        token = int(logits.argmax())
        tokens.append(token)
        if step + 1 < max_new_tokens:
            logits = model([torch.tensor([token])], [state])[0]
    return tokens


def greedy_generate(
    model: DeepseekV4, prompt: torch.Tensor, max_new_tokens: int, chunk_sizes: Iterable[int] = ()
) -> list[int]:
    state = model.new_state()
    return decode_greedy(model, state, prefill(model, state, prompt, chunk_sizes), max_new_tokens)
