"""Prometheus view of the grammar compiler (epd_grammar_*): outcome counts and compile times
counted in plain objects on the request path, read only when scraped (services/runtime/metrics.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.runtime.metrics import Histogram, ServiceMetrics


@dataclass(slots=True)
class CompileCounts:
    requests: int = 0       # GrammarCompile messages answered (any outcome)
    compiled: int = 0       # compiles this service ran that succeeded
    unsupported: int = 0    # GRAMMAR_UNSUPPORTED answers (cached ones included)
    invalid: int = 0        # INVALID_REQUEST answers (wrong tokenizer or key included)
    timeouts: int = 0       # GRAMMAR_TIMEOUT answers (cached ones included)
    failed: int = 0         # other errors (a crashed or missing process, overload)
    compile_s: Histogram = field(default_factory=Histogram)   # compile times of the compiles that succeeded


def declare_metrics(metrics: ServiceMetrics, svc) -> None:
    """The compiler's families, read from `svc` (its counts, cache and pool) at scrape time."""
    for name, doc, read in (
            ("requests", "GrammarCompile requests answered", lambda: svc.counts.requests),
            ("compiles", "Constraints compiled successfully by this service", lambda: svc.counts.compiled),
            ("cache_hits", "Answers from a cached artifact", lambda: svc.cache.stats.hits),
            ("cache_error_hits", "Answers from a cached failure (no recompile)", lambda: svc.cache.stats.error_hits),
            ("cache_joins", "Requests that joined a compile under way", lambda: svc.cache.stats.joins),
            ("cache_evictions", "Artifacts dropped to stay under cache_bytes", lambda: svc.cache.stats.evictions),
            ("unsupported", "Constraints refused as GRAMMAR_UNSUPPORTED", lambda: svc.counts.unsupported),
            ("invalid", "Requests refused as INVALID_REQUEST", lambda: svc.counts.invalid),
            ("timeouts", "Constraints refused as GRAMMAR_TIMEOUT", lambda: svc.counts.timeouts),
            ("failures", "Requests failed otherwise (crashed or missing process, overload)", lambda: svc.counts.failed),
            ("process_kills", "Compile processes killed at the hard timeout", lambda: svc.pool.stats.timeouts),
            ("process_crashes", "Compile processes that died while compiling", lambda: svc.pool.stats.crashes)):
        metrics.counter(f"epd_grammar_{name}", doc, read)
    for name, doc, read in (
            ("cache_bytes", "Bytes held by the grammar cache", lambda: svc.cache.bytes),
            ("cache_entries", "Entries (artifacts and failures) in the grammar cache", lambda: len(svc.cache)),
            ("processes_busy", "Compile processes running a job", lambda: svc.pool.busy),
            ("queued", "Compiles waiting for a free process", lambda: svc.pool.queued)):
        metrics.gauge(f"epd_grammar_{name}", doc, read)
    metrics.histogram("epd_grammar_compile_seconds", "Time to compile and check one constraint (successful compiles)",
                      lambda: svc.counts.compile_s)
