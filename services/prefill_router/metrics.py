"""Prometheus view of the prefill router's buckets and counts, read at scrape time."""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.prefill_router.core import PrefillRouterCore

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


class RouterCollector:
    def __init__(self, core: PrefillRouterCore, kind: str, instance: str):
        self.core = core
        self.labels = [kind, instance]

    def collect(self):
        core, names = self.core, ["kind", "instance", "bucket"]
        gauges = (
            ("epd_prefill_bucket_engines", "Engine groups serving the bucket", core.engines_per_bucket()),
            ("epd_prefill_bucket_queued", "Requests waiting in the bucket", core.queue_lengths()),
            ("epd_prefill_bucket_quota_share", "The bucket's share of the last round's compute quota",
             core.quota_shares()),
        )
        for name, doc, values in gauges:
            family = GaugeMetricFamily(name, doc, labels=names)
            for bucket, value in enumerate(values):
                family.add_metric([*self.labels, str(bucket)], value)
            yield family
        for name, doc in _COUNTERS:
            family = CounterMetricFamily(f"epd_prefill_router_{name}", doc, labels=["kind", "instance"])
            family.add_metric(self.labels, getattr(core.stats, name))
            yield family
