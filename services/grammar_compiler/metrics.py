"""Prometheus view of the grammar compiler: outcome counts and compile times counted in plain
objects on the request path, turned into metric families only when scraped."""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(slots=True)
class CompileCounts:
    requests: int = 0       # GrammarCompile messages answered (any outcome)
    compiled: int = 0       # compiles this service ran that succeeded
    unsupported: int = 0    # GRAMMAR_UNSUPPORTED answers (cached ones included)
    invalid: int = 0        # INVALID_REQUEST answers (wrong tokenizer or key included)
    timeouts: int = 0       # GRAMMAR_TIMEOUT answers (cached ones included)
    failed: int = 0         # other errors (a crashed or missing process, overload)
    buckets: list[int] = field(default_factory=lambda: [0] * (len(COMPILE_BUCKETS) + 1))
    seconds: float = 0.0    # total of compiles that ran (successful ones)

    def observe_compile(self, seconds: float) -> None:
        self.buckets[bisect_left(COMPILE_BUCKETS, seconds)] += 1
        self.seconds += seconds


class CompilerCollector:
    def __init__(self, service, kind: str, instance: str):
        self.service = service
        self.names = ["kind", "instance"]
        self.values = [kind, instance]

    def collect(self):
        svc = self.service
        counts, cache = svc.counts, svc.cache.stats
        for name, doc, value in (
                ("requests", "GrammarCompile requests answered", counts.requests),
                ("compiles", "Constraints compiled successfully by this service", counts.compiled),
                ("cache_hits", "Answers from a cached artifact", cache.hits),
                ("cache_error_hits", "Answers from a cached failure (no recompile)", cache.error_hits),
                ("cache_joins", "Requests that joined a compile under way", cache.joins),
                ("cache_evictions", "Artifacts dropped to stay under cache_bytes", cache.evictions),
                ("unsupported", "Constraints refused as GRAMMAR_UNSUPPORTED", counts.unsupported),
                ("invalid", "Requests refused as INVALID_REQUEST", counts.invalid),
                ("timeouts", "Constraints refused as GRAMMAR_TIMEOUT", counts.timeouts),
                ("failures", "Requests failed otherwise (crashed or missing process, overload)", counts.failed),
                ("process_kills", "Compile processes killed at the hard timeout", svc.pool.stats.timeouts),
                ("process_crashes", "Compile processes that died while compiling", svc.pool.stats.crashes)):
            family = CounterMetricFamily(f"epd_grammar_{name}", doc, labels=self.names)
            family.add_metric(self.values, value)
            yield family
        for name, doc, value in (
                ("cache_bytes", "Bytes held by the grammar cache", svc.cache.bytes),
                ("cache_entries", "Entries (artifacts and failures) in the grammar cache", len(svc.cache)),
                ("processes_busy", "Compile processes running a job", svc.pool.busy),
                ("queued", "Compiles waiting for a free process", svc.pool.queued)):
            gauge = GaugeMetricFamily(f"epd_grammar_{name}", doc, labels=self.names)
            gauge.add_metric(self.values, value)
            yield gauge
        histogram = HistogramMetricFamily("epd_grammar_compile_seconds",
                                          "Time to compile and check one constraint (successful compiles)",
                                          labels=self.names)
        cumulative, running = [], 0
        for bound, count in zip((*COMPILE_BUCKETS, float("inf")), counts.buckets):
            running += count
            cumulative.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        histogram.add_metric(self.values, cumulative, counts.seconds)
        yield histogram

