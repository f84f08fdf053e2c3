"""Per-token mask time of one grammar: a random walk through it, any library's matcher.

A matcher here is anything with `fill(row)` (the next token's bitmask into a CPU int32 row of
ceil(V / 32) words), `accept(token) -> bool`: engine.grammar.GrammarState for llguidance, the
adapter's XGrammarMatcher for xgrammar. Each step fills the mask (timed) and accepts one token drawn
at random from what the mask allows (stop tokens left out while anything else is allowed), so the
walk visits the grammar's real states, strings and structure alike. When only a stop token is left
the grammar is complete: a fresh matcher starts over (its build is timed apart, as `matcher ms`).
"""
from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from bench.stack.command import pick


class RejectedToken(RuntimeError):
    """The matcher refused a token its own mask allowed (a library limit or bug); `matcher` is kept
    so the library can say why."""

    def __init__(self, message: str, matcher):
        super().__init__(message)
        self.matcher = matcher


def allowed_tokens(row: torch.Tensor, vocab_size: int) -> np.ndarray:
    """Token ids whose bit is set: bit b of word w is token 32 * w + b."""
    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


def walk(new_matcher: Callable[[], object], tokens: int, vocab_size: int, stop_ids: Sequence[int],
         seed: int) -> dict:
    """Mask p50 / p99 / max in microseconds over `tokens` masks, matcher builds in milliseconds."""
    rng = random.Random(seed)
    row = torch.empty((vocab_size + 31) // 32, dtype=torch.int32)
    stops = np.asarray(sorted(stop_ids))
    masks_us, builds_ms, restarts, allowed_counts = [], [], 0, []
    matcher, fresh = _build(new_matcher, builds_ms), True
    while len(masks_us) < tokens:
        started = time.perf_counter()
        matcher.fill(row)
        masks_us.append((time.perf_counter() - started) * 1e6)
        allowed = allowed_tokens(row, vocab_size)
        allowed_counts.append(len(allowed))
        choices = np.setdiff1d(allowed, stops, assume_unique=True)
        if len(choices) == 0:
            if len(allowed) == 0:
                raise RuntimeError("the mask allows no token at all: the matcher is in an error state")
            if fresh:
                raise RuntimeError("the grammar allows only a stop token from its start")
            matcher, fresh = _build(new_matcher, builds_ms), True
            restarts += 1
            continue
        token = int(choices[rng.randrange(len(choices))])
        if not matcher.accept(token):
            raise RejectedToken(f"token {token} at step {len(masks_us)}: allowed by the mask, rejected by the "
                                f"matcher", matcher)
        fresh = False
    return {"tokens": len(masks_us), "p50_us": round(pick(masks_us, 0.5), 1), "p99_us": round(pick(masks_us, 0.99), 1),
            "max_us": round(max(masks_us), 1), "matcher_ms": round(pick(builds_ms, 0.5), 2),
            "matchers": len(builds_ms), "restarts": restarts,
            "allowed_median": int(pick(allowed_counts, 0.5))}


def _build(new_matcher: Callable[[], object], builds_ms: list[float]):
    started = time.perf_counter()
    matcher = new_matcher()
    builds_ms.append((time.perf_counter() - started) * 1e3)
    return matcher
