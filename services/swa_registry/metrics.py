"""Prometheus view of the SWA registry's counts (epd_swa_*), read at scrape time
(services/runtime/metrics.py): nothing on the hot path."""
from __future__ import annotations

from services.runtime.metrics import ServiceMetrics
from services.swa_registry.core import SwaRegistry

_COUNTERS = (
    ("registrations", "Hashes registered (new or replaced)"),
    ("lookups", "Hashes looked up"),
    ("hits", "Looked-up hashes that had a live holder"),
    ("misses", "Looked-up hashes with no live holder"),
    ("evictions", "Entries evicted because the registry was full"),
    ("expirations", "Entries removed because their TTL ran out"),
    ("unregistrations", "Entries removed by their holder"),
    ("dropped", "Entries removed because their holder died, went silent or restarted"),
    ("restarts", "Holders seen with a new incarnation at their old address"),
)


def declare_metrics(metrics: ServiceMetrics, registry: SwaRegistry) -> None:
    metrics.gauge("epd_swa_entries", "Live (hash, holder) entries in the SWA registry", lambda: len(registry))
    metrics.gauge("epd_swa_holder_processes", "Worker processes checked in (by incarnation)",
                  lambda: len(registry.tracked))
    for name, doc in _COUNTERS:
        metrics.counter(f"epd_swa_{name}", doc, lambda name=name: getattr(registry.stats, name))
