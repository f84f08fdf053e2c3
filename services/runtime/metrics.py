"""Prometheus metrics of one service instance (its own registry: no process-global state).

The per-message metrics (messages in/out by type, errors by code, handler latency by type) are
counted in plain dicts on the hot path and turned into metric families only when scraped: a
prometheus_client child's inc() or observe() takes a lock and several calls, a few microseconds on
every message; a dict update costs a tenth of that. Names, labels and buckets are unchanged.
"""
from __future__ import annotations

from bisect import bisect_left

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServiceMetrics:
    def __init__(self, kind: str, instance: str):
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"kind": kind, "instance": instance}
        r = self.registry

        def gauge(name, doc):
            return Gauge(name, doc, list(labels), registry=r).labels(**labels)

        self._labels = labels
        self._in: dict[str, int] = {}
        self._out: dict[str, int] = {}
        self._errors: dict[str, int] = {}
        self._latency: dict[str, list] = {}   # type -> [count per bucket (+Inf last), sum]
        self.queue_depth = gauge("epd_queue_depth", "Inbound messages waiting for a handler")
        self.in_flight = gauge("epd_in_flight", "Work items being handled")
        self.state = gauge("epd_state", "0 starting, 1 running, 2 draining, 3 stopped")
        self.peers_alive = gauge("epd_peers_alive", "Registered peers that heartbeat")
        r.register(_MessageCollector(self))

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
            hist = self._latency[type_name] = [[0] * (len(_LATENCY_BUCKETS) + 1), 0.0]
        hist[0][bisect_left(_LATENCY_BUCKETS, seconds)] += 1   # the first bucket whose bound is >= seconds
        hist[1] += seconds

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _MessageCollector:
    """Builds the per-message families from ServiceMetrics' dicts at scrape time."""

    def __init__(self, metrics: ServiceMetrics):
        self.m = metrics

    def describe(self):
        return []   # names are known only at collect time; nothing to check against other collectors

    def collect(self):
        m = self.m
        names, values = list(m._labels), list(m._labels.values())
        for name, doc, counts, key in (("epd_messages_in", "Messages received, by type", m._in, "type"),
                                       ("epd_messages_out", "Messages sent, by type", m._out, "type"),
                                       ("epd_errors", "Errors, by code", m._errors, "code")):
            family = CounterMetricFamily(name, doc, labels=[*names, key])
            for label, count in list(counts.items()):
                family.add_metric([*values, label], count)
            yield family
        family = HistogramMetricFamily("epd_handle_seconds", "Handler latency, by message type",
                                       labels=[*names, "type"])
        for type_name, (buckets, total) in list(m._latency.items()):
            cumulative, running = [], 0
            for bound, count in zip((*_LATENCY_BUCKETS, float("inf")), buckets):
                running += count
                cumulative.append((_bound(bound), running))
            family.add_metric([*values, type_name], cumulative, total)
        yield family


def _bound(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))
