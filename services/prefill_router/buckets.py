"""Length buckets, the compute quota, and how many engines (DP groups) each bucket gets.

Seeds (000, 001): requests are split by total input length into 4 buckets so that requests whose
compute differs by orders of magnitude never queue behind each other; each bucket has its own
engines, and the number of engines per bucket follows the bucket's share of the previous round's
compute-quota demand, quota = alpha * (total - hit + theta)^2 + beta * hit. DeepSeek calls the
formula schematic and alpha/beta/theta fitted parameters without giving values, and give no
bucket boundaries: the defaults below are ours (see QuotaModel and DEFAULT_BOUNDS).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

# Upper bounds (inclusive) of every bucket but the last: <=4k, <=16k, <=64k, larger. Ours: powers of
# 4, so each bucket's uncached quadratic cost spans about one order of magnitude more than the last.
DEFAULT_BOUNDS = (4096, 16384, 65536)


def check_bounds(bounds: Sequence[int]) -> tuple[int, ...]:
    bounds = tuple(bounds)
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in bounds):
        raise ValueError(f"bucket bounds must be positive integers, got {bounds}")
    if any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"bucket bounds must be strictly increasing, got {bounds}")
    return bounds


def bucket_of(total_tokens: int, bounds: Sequence[int] = DEFAULT_BOUNDS) -> int:
    """Bucket index of a request with `total_tokens` of input: the first bound >= total (upper
    bounds inclusive), or len(bounds) when it exceeds them all. With the defaults: 1..4096 -> 0,
    4097..16384 -> 1, 16385..65536 -> 2, 65537.. -> 3."""
    return bisect.bisect_left(bounds, total_tokens)


@dataclass(frozen=True, slots=True)
class QuotaModel:
    """quota = alpha * (total - hit + theta)^2 + beta * hit, in arbitrary units (only shares matter,
    so alpha's scale is free). Defaults (ours; DeepSeek gives none): theta = 4096 makes the cost of
    an uncached token grow linearly (the MLP / MoE part, 2 * alpha * theta per token) until the
    uncached length nears theta, then quadratically (attention); beta = 1024 prices a cached token
    (loaded, attended to) at 1/8 of an uncached one at small lengths."""

    alpha: float = 1.0
    beta: float = 1024.0
    theta: float = 4096.0

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(f"quota {name} must be a finite number >= 0, got {value!r}")
        if self.alpha == 0 and self.beta == 0:
            raise ValueError("quota alpha and beta cannot both be 0")

    def __call__(self, total_tokens: int, hit_tokens: int) -> float:
        if not 0 <= hit_tokens <= total_tokens:
            raise ValueError(f"hit {hit_tokens} must be within 0..total {total_tokens}")
        return self.alpha * (total_tokens - hit_tokens + self.theta) ** 2 + self.beta * hit_tokens


def engine_targets(engines: int, weights: Sequence[float], demanding: Sequence[bool]) -> list[int]:
    """How many engines each bucket gets: proportional to `weights` (a bucket's quota demand) among
    the `demanding` buckets, each of them at least 1 while engines last, the rest by largest
    remaining deficit (engines * share - given; ties to the shorter bucket). With fewer engines
    than demanding buckets, the heaviest buckets get one each. Buckets without demand get 0;
    when no bucket has demand, every bucket counts as demanding with equal weight."""
    if len(weights) != len(demanding):
        raise ValueError("weights and demanding must have one entry per bucket")
    if engines < 0 or any(w < 0 or not math.isfinite(w) for w in weights):
        raise ValueError("engines and weights must be >= 0")
    want = [b for b, d in enumerate(demanding) if d] or list(range(len(weights)))
    total = sum(weights[b] for b in want)
    share = {b: (weights[b] / total if total > 0 else 1.0 / len(want)) for b in want}
    counts = [0] * len(weights)
    if engines <= len(want):
        for b in sorted(want, key=lambda b: (-share[b], b))[:engines]:
            counts[b] = 1
        return counts
    for b in want:
        counts[b] = 1
    for _ in range(engines - len(want)):
        best = max(want, key=lambda b: (engines * share[b] - counts[b], -b))
        counts[best] += 1
    return counts


def reassign(current: Mapping[str, int], groups: Sequence[str], targets: Sequence[int],
             load: Mapping[str, float]) -> dict[str, int]:
    """Give each group a bucket so that bucket b has targets[b] groups, moving as few as possible:
    a group stays where it is while its bucket needs it; the least-loaded groups leave an
    over-staffed bucket first (they can switch soonest) and unplaced groups fill the buckets with
    the largest shortfall, least loaded first. Ties go by name, so the result is deterministic."""
    if sum(targets) != len(groups):
        raise ValueError(f"targets {list(targets)} do not add up to {len(groups)} groups")
    order = sorted(groups, key=lambda g: (load.get(g, 0.0), g))
    members: list[list[str]] = [[] for _ in targets]
    free: list[str] = []
    for g in order:
        b = current.get(g)
        (members[b] if b is not None and 0 <= b < len(targets) else free).append(g)
    for b, keep in enumerate(targets):
        extra = len(members[b]) - keep
        if extra > 0:
            free.extend(members[b][:extra])     # least loaded leave first
            members[b] = members[b][extra:]
    free.sort(key=lambda g: (load.get(g, 0.0), g))
    result = {g: b for b, gs in enumerate(members) for g in gs}
    while free:
        b = max(range(len(targets)), key=lambda b: (targets[b] - len(members[b]), -b))
        g = free.pop(0)
        members[b].append(g)
        result[g] = b
    return result
