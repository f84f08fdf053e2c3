"""Prometheus view of the KV store (epd_kv_*), read at scrape time (services/runtime/metrics.py):
nothing on the write path, and nothing at all before the store is open."""
from __future__ import annotations

from services.runtime.metrics import ServiceMetrics

_COUNTERS = (
    ("records_written", "Records (pages) written"),
    ("bytes_written", "Record bytes written (headers included)"),
    ("records_skipped", "Pages not written because the store already held them"),
    ("write_errors", "Write calls that failed with an I/O error"),
    ("records_read", "Records read back intact"),
    ("bytes_read", "Record bytes read back intact"),
    ("read_misses", "Records the index named that could not be served"),
    ("corrupt_records", "Records that failed their checksum or format check"),
    ("lookups", "Prefix lookups"),
    ("lookup_blocks", "Blocks asked in prefix lookups"),
    ("lookup_hits", "Blocks found by prefix lookups"),
    ("segments_evicted", "Segments dropped to stay under capacity"),
    ("records_evicted", "Records dropped with evicted segments"),
    ("segments_expired", "Segments dropped by gc (every record expired)"),
    ("records_expired", "Records dropped by gc"),
    ("segments_recovered", "Unsealed segments verified and sealed at start"),
)


def declare_metrics(metrics: ServiceMetrics, svc) -> None:
    """The writer's families, read from `svc.store` (None until it opens) at scrape time."""
    def of_store(read):
        return lambda: None if svc.store is None else read(svc.store)

    for name, doc, read in (("records", "Records in the index", len),
                            ("segments", "Segment files", lambda store: store.segment_count),
                            ("bytes_stored", "Bytes in segment files", lambda store: store.bytes_stored),
                            ("pending_write_bytes", "Page bytes waiting for the writer thread",
                             lambda store: svc.pending_bytes)):
        metrics.gauge(f"epd_kv_{name}", doc, of_store(read))
    for name, doc in _COUNTERS:
        metrics.counter(f"epd_kv_{name}", doc, of_store(lambda store, name=name: getattr(store.stats, name)))
