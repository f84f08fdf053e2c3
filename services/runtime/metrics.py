"""Prometheus metrics of one service instance (its own registry: no process-global state).

One way to export a number: a service counts in plain ints, dicts and `Histogram`s on its hot path
and declares each metric once with a reader (`ServiceMetrics.counter`, `.gauge`, `.histogram`);
the readers run only when /metrics is scraped. A prometheus_client child's inc() or observe() takes
a lock and several calls, a few microseconds on every message; a dict update costs a tenth of that.
Every family carries the `kind` and `instance` labels; `by` names one more label, and its reader
then returns {label value: number}. A reader returning None has nothing to report yet (the family
is left out of that scrape).
"""
from __future__ import annotations

from bisect import bisect_left
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

_FAMILIES = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "histogram": HistogramMetricFamily}


class Histogram:
    """Observations per bucket and their sum; a bucket holds values up to and including its bound."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...] = DURATION_BUCKETS):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)   # the last is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, observations <= le) per bucket, as the exposition writes them."""
        out, running = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        return out


class ServiceMetrics:
    def __init__(self, kind: str, instance: str):
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"kind": kind, "instance": instance}
        r = self.registry

        def gauge(name, doc):
            return Gauge(name, doc, list(labels), registry=r).labels(**labels)

        self._labels = labels
        self._declared: list[tuple[str, str, str, Callable[[], Any], str]] = []
        self._in: dict[str, int] = {}
        self._out: dict[str, int] = {}
        self._errors: dict[str, int] = {}
        self._latency: dict[str, Histogram] = {}
        self.queue_depth = gauge("epd_queue_depth", "Inbound messages waiting for a handler")
        self.in_flight = gauge("epd_in_flight", "Work items being handled")
        self.state = gauge("epd_state", "0 starting, 1 running, 2 draining, 3 stopped")
        self.peers_alive = gauge("epd_peers_alive", "Registered peers that heartbeat")
        r.register(_Declared(self))
        self.counter("epd_messages_in", "Messages received, by type", lambda: self._in, by="type")
        self.counter("epd_messages_out", "Messages sent, by type", lambda: self._out, by="type")
        self.counter("epd_errors", "Errors, by code", lambda: self._errors, by="code")
        self.histogram("epd_handle_seconds", "Handler latency, by message type", lambda: self._latency, by="type")

    # ---- declaring a metric: a name, its help, and a reader run at scrape time ------------
    def counter(self, name: str, doc: str, read: Callable[[], Any], by: str = "") -> None:
        self._declared.append(("counter", name, doc, read, by))

    def gauge(self, name: str, doc: str, read: Callable[[], Any], by: str = "") -> None:
        self._declared.append(("gauge", name, doc, read, by))

    def histogram(self, name: str, doc: str, read: Callable[[], Any], by: str = "") -> None:
        """`read` returns a Histogram (with `by`: {label value: Histogram})."""
        self._declared.append(("histogram", name, doc, read, by))

    # ---- the per-message counts every service keeps ---------------------------------------
    def received(self, type_name: str) -> None:
        counts = self._in
        counts[type_name] = counts.get(type_name, 0) + 1

    def sent(self, type_name: str) -> None:
        counts = self._out
        counts[type_name] = counts.get(type_name, 0) + 1

    def error(self, code: str) -> None:
        counts = self._errors
        counts[code] = counts.get(code, 0) + 1

    def observe(self, type_name: str, seconds: float) -> None:
        hist = self._latency.get(type_name)
        if hist is None:
            hist = self._latency[type_name] = Histogram(LATENCY_BUCKETS)
        hist.observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _Declared:
    """The families ServiceMetrics declared, built from their readers at scrape time."""

    def __init__(self, metrics: ServiceMetrics):
        self.m = metrics

    def describe(self):
        return []   # families are declared after registration; nothing to check against other collectors

    def collect(self):
        names, values = list(self.m._labels), list(self.m._labels.values())
        for kind, name, doc, read, by in list(self.m._declared):
            value = read()
            if value is None:
                continue
            family = _FAMILIES[kind](name, doc, labels=[*names, by] if by else names)
            samples = [([*values, str(label)], v) for label, v in list(value.items())] if by else [(values, value)]
            for labels, sample in samples:
                if kind == "histogram":
                    family.add_metric(labels, sample.cumulative(), sample.total)
                else:
                    family.add_metric(labels, sample)
            yield family
