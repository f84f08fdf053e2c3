"""Helpers shared by the engine tests."""

from __future__ import annotations

import torch

TEST_VOCAB = 1024


def rel_err(reference: torch.Tensor, ours: torch.Tensor) -> float:
    """max |difference| / max |reference|."""
    return ((reference.float() - ours.float()).abs().max() / reference.float().abs().max()).item()


def make_prompt(length: int, seed: int, vocab: int = TEST_VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(10_000 * seed + length))
