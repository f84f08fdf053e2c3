"""The simulation of `epd bench vision`: the vision pool at production scale (groups of 8 cards,
several groups), the balancing policies compared on one trace.

Each request picks a group at random (the same picks for every policy: paired runs); the group's
leader is the real `BalancerCore` (placement, counts, release on done), so the policy simulated is
the code that serves. Each card runs its jobs first come, first served; an image costs
`overhead_s + patches * s_per_patch` (a batch's cost is the sum of its images': the brief's linear
model, which leaves out attention's quadratic term and batching gains). A job's patches leave the
leader's count when the card finishes it. Latency = the request's last image done - its arrival.
"""
from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

from bench.vision.trace import TraceRequest
from services.vision_balancer.core import BalancerCore, Placement


@dataclass(slots=True, frozen=True)
class CostModel:
    s_per_patch: float = 2.5e-6   # ~1 GFLOP a patch (V4.1's 32-layer ViT) at ~400 TFLOP/s
    overhead_s: float = 0.5e-3    # per image: preprocessing copy, launch, the rows' transfer

    def image_s(self, patches: int) -> float:
        return self.overhead_s + patches * self.s_per_patch

    def request_s(self, request: TraceRequest) -> float:
        return sum(self.image_s(image.patches) for image in request.images)


def arrival_scale(trace: list[TraceRequest], cards: int, load: float, cost: CostModel) -> float:
    """The factor on the trace's arrival times (drawn at 1 request/s) that makes the pool `load` busy."""
    mean_s = sum(cost.request_s(r) for r in trace) / len(trace)
    rate = load * cards / mean_s
    return 1.0 / rate


def simulate(trace: list[TraceRequest], groups: int, cards: int, policy: str, cost: CostModel,
             scale: float, seed: int = 0) -> list[float]:
    """Latency (s) of every request of `trace`, arrivals multiplied by `scale`."""
    pick_group = random.Random(seed)
    leaders = [BalancerCore(policy, random.Random(seed * 1000 + g)) for g in range(groups)]
    names = [[f"g{g}-card{c}" for c in range(cards)] for g in range(groups)]
    free_at: dict[str, float] = {}
    completions: list[tuple[float, int, str, str]] = []   # (time, group, job id, card)
    latencies = []
    for number, request in enumerate(trace):
        now = request.arrival_s * scale
        while completions and completions[0][0] <= now:
            _, g, job_id, card = heapq.heappop(completions)
            leaders[g].done(job_id, card)
        g = pick_group.randrange(groups)
        placements = [Placement(i, image.patches) for i, image in enumerate(request.images)]
        last = now
        for job in leaders[g].dispatch(str(number), names[g], placements, None):
            start = max(now, free_at.get(job.worker, 0.0))
            finish = start + sum(cost.image_s(request.images[i].patches) for i in job.positions)
            free_at[job.worker] = finish
            heapq.heappush(completions, (finish, g, job.id, job.worker))
            last = max(last, finish)
        latencies.append(last - now)
    return latencies
