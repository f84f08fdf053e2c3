"""Prometheus view of a vision balancer (epd_vision_balancer_*), read at scrape time
(services/runtime/metrics.py)."""
from __future__ import annotations

from dataclasses import dataclass

from services.runtime.metrics import ServiceMetrics


@dataclass(slots=True)
class BalancerCounts:
    requests: int = 0       # VisionEncode calls accepted
    images: int = 0         # images forwarded to a worker (a re-dispatch counts again)
    patches: int = 0        # their patches
    redispatched: int = 0   # jobs placed again after their worker died or refused them
    failed: int = 0         # images answered VisionFailed by the leader (no worker could take them)
    cancelled: int = 0      # jobs cancelled
    jobs_done: int = 0      # VisionDone reports that settled a job


_COUNTERS = (
    ("requests", "VisionEncode calls accepted"),
    ("images", "Images forwarded to a vision worker"),
    ("patches", "Patches of the images forwarded"),
    ("redispatched", "Jobs placed again after their worker died or refused them"),
    ("failed", "Images answered VisionFailed because no worker could take them"),
    ("cancelled", "Jobs cancelled"),
    ("jobs_done", "Jobs reported done by their worker"),
)


def declare_metrics(metrics: ServiceMetrics, svc) -> None:
    """The leader's families, read from `svc` (its counts and its core) at scrape time."""
    for name, doc in _COUNTERS:
        metrics.counter(f"epd_vision_balancer_{name}", doc, lambda name=name: getattr(svc.counts, name))
    metrics.gauge("epd_vision_balancer_jobs", "Jobs on workers, not yet reported done", lambda: len(svc.core.jobs))
    metrics.gauge("epd_vision_balancer_queued_patches", "Patches queued on each worker, by the leader's count",
                  lambda: {name: queue.patches for name, queue in sorted(svc.core.queues.items())}, by="worker")
