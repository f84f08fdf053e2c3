"""DecodeRouterCore: which decode instance takes a request, by score (seeds 000/001).

score = alpha * kv_usage + beta * batch_norm, lowest wins. The seeds balance both dimensions
because either alone fails: by request count alone long contexts pile up on one instance, by KV
length alone batch sizes drift apart. They give no values for alpha and beta; ours weigh the two
equally (1.0, 1.0), which is what "balance both" means once both are on a 0..1 scale:

- kv_usage: the fraction of KV pages in use that the worker reports (clamped to 0..1);
- batch_norm: the estimated batch size (reported batch_size plus the requests picked for it in
  the last `pick_hold_s`, which its heartbeats cannot show yet: their prefill is still running)
  divided by the worker's reported capacity when it reports one (> 0), else by the largest
  estimated batch among the eligible workers (0 when all are empty).

Eligible: alive and RUNNING (draining and dead workers are skipped) and, when it reports a
capacity, estimated batch below it. Ties go to the smaller estimated batch, then the instance
name, so the choice is deterministic. No eligible worker: Overloaded. Pure and synchronous, with
an injectable clock.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

from messages.control import Load
from messages.errors import Overloaded


@dataclass(frozen=True, slots=True)
class DecodePolicy:
    alpha: float = 1.0        # weight of kv_usage (ours; the seeds give no value)
    beta: float = 1.0         # weight of the normalised batch size (ours)
    pick_hold_s: float = 5.0  # a pick counts toward its worker's batch this long (ours: ~ a prefill)

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "pick_hold_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class DecodeCandidate:
    """What the shell knows about one decode worker (from Register and its last Heartbeat)."""

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


@dataclass(slots=True)
class DecodeStats:
    picks: int = 0
    refused: int = 0


class DecodeRouterCore:
    def __init__(self, policy: DecodePolicy | None = None, clock: Callable[[], float] = time.monotonic):
        self.policy = policy or DecodePolicy()
        self.clock = clock
        self.stats = DecodeStats()
        self._recent: dict[str, deque[float]] = {}    # instance -> times of recent picks

    def pending(self, instance: str, now: float | None = None) -> int:
        """Picks for `instance` in the last pick_hold_s."""
        now = self.clock() if now is None else now
        recent = self._recent.get(instance)
        if recent is None:
            return 0
        while recent and recent[0] <= now - self.policy.pick_hold_s:
            recent.popleft()
        if not recent:
            del self._recent[instance]
            return 0
        return len(recent)

    def rank(self, candidates: Iterable[DecodeCandidate], now: float | None = None) -> list[Scored]:
        """Eligible workers, best first."""
        now = self.clock() if now is None else now
        estimated = []
        for c in candidates:
            if not c.accepts_work:
                continue
            batch = max(0, c.load.batch_size) + self.pending(c.instance, now)
            if c.load.capacity > 0 and batch >= c.load.capacity:
                continue
            estimated.append((c, batch))
        widest = max((batch for _, batch in estimated), default=0)
        scored = []
        for c, batch in estimated:
            scale = c.load.capacity if c.load.capacity > 0 else widest
            norm = batch / scale if scale else 0.0
            scored.append(Scored(c, score(c.load.kv_usage, norm, self.policy.alpha, self.policy.beta), batch))
        scored.sort(key=lambda s: (s.score, s.batch, s.instance))
        return scored

    def pick(self, candidates: Iterable[DecodeCandidate], now: float | None = None) -> DecodeCandidate:
        """The lowest-scoring eligible worker, counted as one more request on it; Overloaded if none."""
        now = self.clock() if now is None else now
        candidates = list(candidates)
        ranked = self.rank(candidates, now)
        if not ranked:
            self.stats.refused += 1
            why = "no decode worker is alive" if not any(c.accepts_work for c in candidates) \
                else "every decode worker is at capacity"
            raise Overloaded(why)
        best = ranked[0].candidate
        self._recent.setdefault(best.instance, deque()).append(now)
        self.stats.picks += 1
        return best

    def forget(self, instance: str) -> None:
        """A worker died: drop its recent picks (a restarted one starts clean)."""
        self._recent.pop(instance, None)
