"""A thinking budget (Anthropic's `thinking.budget_tokens`): the thinking section ends on time.

A request in thinking mode starts generating inside its thinking section (its prompt ends with the
opening tag). With `SamplingParams.thinking_budget` = N >= 0, output token N is forced to
`think_end_id` unless the model already closed the section itself; the answer then continues as
usual. The force is a mask over the logits, like a grammar's: the draw can only pick that token,
and reported logprobs stay those of the model's own distribution (runner.py).
"""
from __future__ import annotations

import math

import torch

from engine.scheduler.sequence import Sequence


def forced_think_end(seq: Sequence) -> int | None:
    """The end-of-thinking token when `seq` is about to sample past its budget still thinking; else None."""
    params = seq.sampling
    if params.thinking_budget < 0 or seq.num_generated != params.thinking_budget:
        return None
    closed = params.think_end_id in seq.token_ids[seq.num_prompt_tokens:]   # scanned once: at the budget
    return None if closed else params.think_end_id


def force_tokens_(logits: torch.Tensor, forced: list[tuple[int, int]]) -> None:
    """In place: each (row, token) row of `logits` [B, V] allows `token` alone."""
    for row, token in forced:
        logits[row].fill_(-math.inf)
        logits[row, token] = 0.0
