"""Prometheus view of a vision worker (epd_vision_*): counted in plain objects on the request path,
read only when scraped (services/runtime/metrics.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.runtime.metrics import Histogram, ServiceMetrics


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


_COUNTERS = (
    ("images", "Images encoded and sent to their prefill worker"),
    ("patches", "Patches of the images encoded"),
    ("failed", "Images answered VisionFailed (bad image, encoder error)"),
    ("cancelled", "Images dropped because their request was cancelled"),
    ("undeliverable", "Encoded images whose prefill worker could not be reached"),
    ("batches", "Encoder batches run"),
)


def declare_metrics(metrics: ServiceMetrics, svc) -> None:
    """The worker's families, read from `svc` (its counts, queue and batch) at scrape time."""
    for name, doc in _COUNTERS:
        metrics.counter(f"epd_vision_{name}", doc, lambda name=name: getattr(svc.counts, name))
    metrics.gauge("epd_vision_queue_patches", "Patches queued or being encoded", lambda: svc.queue.queued_patches)
    metrics.gauge("epd_vision_queue_images", "Images waiting for a batch", lambda: len(svc.queue))
    metrics.gauge("epd_vision_batch_images", "Images in the batch being encoded", lambda: svc.batch_size)
    metrics.histogram("epd_vision_encode_seconds", "Encoder time per batch (preprocessing excluded)",
                      lambda: svc.counts.encode)
    metrics.histogram("epd_vision_preprocess_seconds", "Decode, resize and patching time per batch",
                      lambda: svc.counts.preprocess)
