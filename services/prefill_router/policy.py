"""The prefill router's vocabulary: its policy, what it knows of a rank, a waiting request, a
handed-out one, and its counters (see core.py for how they are used)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from messages.control import Load
from services.prefill_router.buckets import DEFAULT_BOUNDS, QuotaModel, check_bounds
from services.runtime.settings import flat_field


@dataclass(frozen=True, slots=True)
class RouterPolicy:
    bucket_bounds: tuple[int, ...] = DEFAULT_BOUNDS   # DeepSeek's 4 buckets; the bounds are ours
    quota: QuotaModel = flat_field(QuotaModel)     # settings give alpha, beta, theta at the top level
    round_s: float = 10.0               # re-balance period (ours; DeepSeek says "last round")
    queue_limit: int = 1024             # requests waiting per bucket
    queue_token_limit: int = 1 << 24    # uncached tokens waiting per bucket (16 Mi)
    max_queue_wait_s: float = 300.0     # a request waiting longer fails OVERLOADED
    rank_token_budget: int = 32768      # a rank pulls while it holds fewer uncached tokens than this
    idle_settle_s: float = 2.0          # see "estimates" above

    def __post_init__(self) -> None:
        object.__setattr__(self, "bucket_bounds", check_bounds(self.bucket_bounds))
        for name in ("round_s", "max_queue_wait_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive finite number")
        if not (math.isfinite(self.idle_settle_s) and self.idle_settle_s >= 0):
            raise ValueError("idle_settle_s must be a finite number >= 0")
        for name in ("queue_limit", "queue_token_limit", "rank_token_budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    @property
    def buckets(self) -> int:
        return len(self.bucket_bounds) + 1


@dataclass(frozen=True, slots=True)
class RankView:
    """What the shell knows about one prefill rank (from Register and its last Heartbeat)."""

    instance: str
    address: str
    group: str
    load: Load = field(default_factory=Load)
    accepts_work: bool = True    # alive and RUNNING (not draining)
    seen_at: float = 0.0         # when its last heartbeat arrived, on the core's clock


@dataclass(slots=True)
class Queued:
    request_id: str
    bucket: int
    prompt_tokens: int
    hit_tokens: int
    quota: float
    enqueued_at: float
    seq: int
    payload: Any = None          # the shell's own data (the request, where to answer, ...)

    @property
    def uncached_tokens(self) -> int:
        return self.prompt_tokens - self.hit_tokens


@dataclass(slots=True)
class Outstanding:
    """A request handed to a rank and not yet seen finished."""

    item: Queued
    instance: str
    address: str
    dispatched_at: float
    admitted: Any = True         # what the pump's `admit` gave it (the shell's decode reservation)

    @property
    def request_id(self) -> str:
        return self.item.request_id


@dataclass(slots=True)
class RouterStats:
    submitted: int = 0
    refused: int = 0          # queue bound reached
    dispatched: int = 0
    finished: int = 0
    cancelled: int = 0
    expired: int = 0          # waited longer than max_queue_wait_s
    lost: int = 0             # held by a rank that died
    settled: int = 0          # cleared by an idle heartbeat
    rounds: int = 0
    moves: int = 0            # groups moved from one bucket to another
