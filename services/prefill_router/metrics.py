"""Prometheus view of the prefill router's buckets and counts, read at scrape time
(services/runtime/metrics.py)."""
from __future__ import annotations

from services.prefill_router.core import PrefillRouterCore
from services.runtime.metrics import ServiceMetrics

_COUNTERS = (
    ("submitted", "Requests submitted to a bucket (refused ones included)"),
    ("refused", "Requests refused because their bucket's queue was full"),
    ("dispatched", "Requests handed to a prefill rank"),
    ("finished", "Requests a prefill rank finished (done or failed)"),
    ("cancelled", "Requests aborted or not deliverable"),
    ("expired", "Requests that waited longer than max_queue_wait_s"),
    ("lost", "Requests held by a prefill rank that died"),
    ("settled", "Hand-outs cleared because the rank reported idle"),
    ("rounds", "Re-balancing rounds"),
    ("moves", "Engine groups moved between buckets"),
)


def declare_metrics(metrics: ServiceMetrics, core: PrefillRouterCore) -> None:
    for name, doc, per_bucket in (
            ("epd_prefill_bucket_engines", "Engine groups serving the bucket", core.engines_per_bucket),
            ("epd_prefill_bucket_queued", "Requests waiting in the bucket", core.queue_lengths),
            ("epd_prefill_bucket_quota_share", "The bucket's share of the last round's compute quota",
             core.quota_shares)):
        metrics.gauge(name, doc, lambda per_bucket=per_bucket: dict(enumerate(per_bucket())), by="bucket")
    for name, doc in _COUNTERS:
        metrics.counter(f"epd_prefill_router_{name}", doc, lambda name=name: getattr(core.stats, name))
