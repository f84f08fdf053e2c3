"""Helpers shared by the engine tests."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

TEST_VOCAB = 1024


def rel_err(reference: torch.Tensor, ours: torch.Tensor) -> float:
    """max |difference| / max |reference|."""
    return ((reference.float() - ours.float()).abs().max() / reference.float().abs().max()).item()


def make_prompt(length: int, seed: int, vocab: int = TEST_VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(10_000 * seed + length))


@dataclass
class Collected:
    """Everything one request produced over the steps of a run."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: object = None
    logprobs: list[float] = field(default_factory=list)
    last: object = None  # the last RequestOutput


def run_engine(engine, max_steps: int = 100_000) -> dict[str, Collected]:
    """Step until idle; request id -> what it produced."""
    results: dict[str, Collected] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return results
        for out in engine.step():
            entry = results.setdefault(out.request_id, Collected())
            entry.tokens += out.new_token_ids
            entry.logprobs += out.logprobs
            entry.finish_reason, entry.last = out.finish_reason, out
    raise AssertionError("engine did not finish")


def greedy_params(max_tokens: int = 64, **kw):
    from messages.common import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=kw.pop("ignore_eos", True), **kw)
