"""The decode score (docs/design/serving.md): which decode instance takes a request, lowest score wins.

score = alpha * kv_usage + beta * batch_norm. DeepSeek balances both dimensions because either
alone fails: by request count alone long contexts pile up on one instance, by KV length alone batch
sizes drift apart. They give no values for alpha and beta; ours weigh the two equally (1.0, 1.0),
which is what "balance both" means once both are on a 0..1 scale:

- kv_usage: the fraction of KV pages in use that the worker reports (clamped to 0..1);
- batch_norm: the estimated batch size (reported batch_size plus `pending`: requests sent its way
  that its reports cannot show yet) divided by the worker's reported capacity when it reports one
  (> 0), else by the largest estimated batch among the eligible workers (0 when all are empty).

Eligible: alive and RUNNING (draining and dead workers are skipped) and, when it reports a
capacity, estimated batch below it. Ties go to the smaller estimated batch, then the instance
name, so the choice is deterministic. The decode router publishes the inputs (DecodeTable); the
prefill router ranks with them (services/prefill_router/decode_slots.py). Pure functions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from messages.control import Load


@dataclass(frozen=True, slots=True)
class DecodePolicy:
    alpha: float = 1.0        # weight of kv_usage (ours; DeepSeek gives no value)
    beta: float = 1.0         # weight of the normalised batch size (ours)

    def __post_init__(self) -> None:
        for name in ("alpha", "beta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class DecodeCandidate:
    """One decode worker as its router last heard it (from Register and its last Heartbeat)."""

    instance: str
    address: str
    load: Load = field(default_factory=Load)
    accepts_work: bool = True     # alive and RUNNING


@dataclass(frozen=True, slots=True)
class Scored:
    candidate: DecodeCandidate
    score: float
    batch: int                    # estimated batch size

    @property
    def instance(self) -> str:
        return self.candidate.instance


def score(kv_usage: float, batch_norm: float, alpha: float = 1.0, beta: float = 1.0) -> float:
    return alpha * min(max(kv_usage, 0.0), 1.0) + beta * batch_norm


def rank(candidates: Iterable[DecodeCandidate], pending: Mapping[str, int] | None = None,
         policy: DecodePolicy = DecodePolicy()) -> list[Scored]:
    """Eligible workers, best first; empty when none can take another request."""
    pending = pending or {}
    estimated = []
    for c in candidates:
        if not c.accepts_work:
            continue
        batch = max(0, c.load.batch_size) + pending.get(c.instance, 0)
        if c.load.capacity > 0 and batch >= c.load.capacity:
            continue
        estimated.append((c, batch))
    widest = max((batch for _, batch in estimated), default=0)
    scored = []
    for c, batch in estimated:
        scale = c.load.capacity if c.load.capacity > 0 else widest
        norm = batch / scale if scale else 0.0
        scored.append(Scored(c, score(c.load.kv_usage, norm, policy.alpha, policy.beta), batch))
    scored.sort(key=lambda s: (s.score, s.batch, s.instance))
    return scored
