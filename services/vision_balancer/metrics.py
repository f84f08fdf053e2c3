"""Prometheus view of a vision balancer (epd_vision_balancer_*), built at scrape time."""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


@dataclass(slots=True)
class BalancerCounts:
    requests: int = 0       # VisionEncode calls accepted
    images: int = 0         # images forwarded to a worker (a re-dispatch counts again)
    patches: int = 0        # their patches
    redispatched: int = 0   # jobs placed again after their worker died or refused them
    failed: int = 0         # images answered VisionFailed by the leader (no worker could take them)
    cancelled: int = 0      # jobs cancelled
    jobs_done: int = 0      # VisionDone reports that settled a job


class VisionBalancerCollector:
    def __init__(self, service, kind: str, instance: str):
        self.service = service
        self.names = ["kind", "instance"]
        self.values = [kind, instance]

    def describe(self):
        return []

    def collect(self):
        svc = self.service
        counts = svc.counts
        for name, doc, value in (
                ("requests", "VisionEncode calls accepted", counts.requests),
                ("images", "Images forwarded to a vision worker", counts.images),
                ("patches", "Patches of the images forwarded", counts.patches),
                ("redispatched", "Jobs placed again after their worker died or refused them", counts.redispatched),
                ("failed", "Images answered VisionFailed because no worker could take them", counts.failed),
                ("cancelled", "Jobs cancelled", counts.cancelled),
                ("jobs_done", "Jobs reported done by their worker", counts.jobs_done)):
            family = CounterMetricFamily(f"epd_vision_balancer_{name}", doc, labels=self.names)
            family.add_metric(self.values, value)
            yield family
        jobs = GaugeMetricFamily("epd_vision_balancer_jobs", "Jobs on workers, not yet reported done",
                                 labels=self.names)
        jobs.add_metric(self.values, len(svc.core.jobs))
        yield jobs
        queued = GaugeMetricFamily("epd_vision_balancer_queued_patches", "Patches queued on each worker, by the "
                                   "leader's count", labels=[*self.names, "worker"])
        for name, queue in sorted(svc.core.queues.items()):
            queued.add_metric([*self.values, name], queue.patches)
        yield queued
