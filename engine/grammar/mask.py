"""The batched token bitmask: filled on the CPU from each row's matcher, applied on the logits' device.

A bitmask row holds ceil(V / 32) int32 words; bit b of word w allows token 32 * w + b. Rows without
an active grammar are all ones, and a row's bits come from its own matcher only, so what a row
samples never depends on the other rows of the batch.
"""
from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import torch

from engine.grammar.matcher import GrammarState

_EXECUTOR = None
_EXECUTOR_LOCK = threading.Lock()
_SHIFTS: dict[torch.device, torch.Tensor] = {}


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_bitmasks(states: Sequence[GrammarState | None], vocab_size: int) -> torch.Tensor:
    """An int32 CPU tensor [len(states), ceil(vocab_size / 32)]: each active state's mask in its row,
    all ones for None or inactive states. Several active rows are filled in parallel by llguidance's
    thread pool (the matchers release the GIL)."""
    words = bitmask_words(vocab_size)
    bitmask = torch.full((len(states), words), -1, dtype=torch.int32)
    active = [(row, state) for row, state in enumerate(states) if state is not None and state.active]
    for _, state in active:
        if state.mask_words != words:
            raise ValueError(f"a matcher's mask has {state.mask_words} words, the logits need {words} "
                             f"(vocab {vocab_size}): its tokenizer was built for another vocabulary size")
    if len(active) == 1:
        row, state = active[0]
        state.fill(bitmask[row])
    elif active:
        matchers = [(state.matcher_for_batch(), row) for row, state in active]
        _executor().unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), words * 4, len(states))
    return bitmask


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set to -inf, in place, every logit whose bit is 0 in its row of `bitmask` [B, words] int32
    (any device: it is copied to the logits' device), and every token past 32 * words. Returns logits."""
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"logits [B, V] and bitmask [B, words] expected, got {list(logits.shape)} and "
                         f"{list(bitmask.shape)}")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    rows, vocab = logits.shape
    covered = min(vocab, 32 * bitmask.shape[1])
    words = bitmask_words(covered)
    bitmask = bitmask[:, :words].to(logits.device, non_blocking=True)
    allowed = ((bitmask.unsqueeze(-1) >> _shifts(logits.device)) & 1).view(rows, 32 * words)[:, :covered]
    # Bit 1 -> +inf, 0 -> -inf, then a clamp: masked_fill_ / where with a bool mask run ~4x slower on CPU.
    logits[:, :covered].clamp_max_(allowed.to(logits.dtype).sub_(0.5).mul_(math.inf))
    if covered < vocab:
        logits[:, covered:] = -math.inf
    return logits


def _shifts(device: torch.device) -> torch.Tensor:
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return shifts


def _executor():
    """One llguidance thread pool per process, made on first use."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            from llguidance import LLExecutor
            _EXECUTOR = LLExecutor()
        return _EXECUTOR
