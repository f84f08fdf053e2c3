"""ServiceMetrics' one way to export a number: declared once with a reader, read at scrape time,
with the kind and instance labels (and `by`'s) on every sample."""
from __future__ import annotations

from services.runtime.metrics import Histogram, ServiceMetrics

LABELS = {"kind": "k", "instance": "i"}


def value(metrics: ServiceMetrics, name: str, **labels):
    return metrics.registry.get_sample_value(name, {**LABELS, **labels})


def test_readers_run_at_each_scrape():
    metrics, counts = ServiceMetrics("k", "i"), {"done": 1, "queued": {"a": 2}}
    metrics.counter("epd_test_done", "Done", lambda: counts["done"])
    metrics.gauge("epd_test_queued", "Queued, by worker", lambda: counts["queued"], by="worker")
    assert value(metrics, "epd_test_done_total") == 1 and value(metrics, "epd_test_queued", worker="a") == 2
    counts["done"], counts["queued"] = 5, {"a": 0, "b": 3}
    assert value(metrics, "epd_test_done_total") == 5
    assert (value(metrics, "epd_test_queued", worker="a"), value(metrics, "epd_test_queued", worker="b")) == (0, 3)


def test_a_histogram_counts_each_value_in_the_first_bucket_that_holds_it():
    metrics, hist = ServiceMetrics("k", "i"), Histogram((0.1, 1.0))
    metrics.histogram("epd_test_seconds", "Seconds", lambda: hist)
    for seconds in (0.1, 0.5, 1.0, 7.0):
        hist.observe(seconds)
    buckets = [value(metrics, "epd_test_seconds_bucket", le=le) for le in ("0.1", "1.0", "+Inf")]
    assert buckets == [1, 3, 4]
    assert value(metrics, "epd_test_seconds_count") == 4 and value(metrics, "epd_test_seconds_sum") == 8.6


def test_a_reader_with_nothing_to_report_leaves_its_family_out():
    metrics, store = ServiceMetrics("k", "i"), {"records": None}
    metrics.gauge("epd_test_records", "Records", lambda: store["records"])
    assert b"epd_test_records" not in metrics.exposition()
    store["records"] = 4
    assert value(metrics, "epd_test_records") == 4
