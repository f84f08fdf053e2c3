"""Prometheus view of a vision worker: counted in plain objects on the request path, turned into
metric families only when scraped (epd_vision_*)."""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

ENCODE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(slots=True)
class Histogram:
    buckets: list[int] = field(default_factory=lambda: [0] * (len(ENCODE_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.buckets[bisect_left(ENCODE_BUCKETS, seconds)] += 1
        self.total += seconds

    def family(self, name: str, doc: str, names: list[str], values: list[str]) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, doc, labels=names)
        cumulative, running = [], 0
        for bound, count in zip((*ENCODE_BUCKETS, float("inf")), self.buckets):
            running += count
            cumulative.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        family.add_metric(values, cumulative, self.total)
        return family


@dataclass(slots=True)
class VisionCounts:
    images: int = 0          # images encoded and sent
    patches: int = 0         # their patches
    failed: int = 0          # images answered VisionFailed
    cancelled: int = 0       # images dropped by a VisionCancel
    undeliverable: int = 0   # encoded images whose receiver could not be reached
    batches: int = 0
    encode: Histogram = field(default_factory=Histogram)       # one observation per batch
    preprocess: Histogram = field(default_factory=Histogram)   # one observation per batch


class VisionWorkerCollector:
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
                ("images", "Images encoded and sent to their prefill worker", counts.images),
                ("patches", "Patches of the images encoded", counts.patches),
                ("failed", "Images answered VisionFailed (bad image, encoder error)", counts.failed),
                ("cancelled", "Images dropped because their request was cancelled", counts.cancelled),
                ("undeliverable", "Encoded images whose prefill worker could not be reached", counts.undeliverable),
                ("batches", "Encoder batches run", counts.batches)):
            family = CounterMetricFamily(f"epd_vision_{name}", doc, labels=self.names)
            family.add_metric(self.values, value)
            yield family
        for name, doc, value in (
                ("queue_patches", "Patches queued or being encoded", svc.queue.queued_patches),
                ("queue_images", "Images waiting for a batch", len(svc.queue)),
                ("batch_images", "Images in the batch being encoded", svc.batch_size)):
            gauge = GaugeMetricFamily(f"epd_vision_{name}", doc, labels=self.names)
            gauge.add_metric(self.values, value)
            yield gauge
        yield counts.encode.family("epd_vision_encode_seconds", "Encoder time per batch (preprocessing excluded)",
                                   self.names, self.values)
        yield counts.preprocess.family("epd_vision_preprocess_seconds", "Decode, resize and patching time per batch",
                                       self.names, self.values)
