"""Prometheus metrics of one service instance (its own registry: no process-global state)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServiceMetrics:
    def __init__(self, kind: str, instance: str):
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"kind": kind, "instance": instance}
        r = self.registry

        def counter(name, doc, extra=()):
            return Counter(name, doc, [*labels, *extra], registry=r)

        def gauge(name, doc):
            return Gauge(name, doc, list(labels), registry=r).labels(**labels)

        self._labels = labels
        self._in = counter("epd_messages_in_total", "Messages received, by type", ("type",))
        self._out = counter("epd_messages_out_total", "Messages sent, by type", ("type",))
        self._errors = counter("epd_errors_total", "Errors, by code", ("code",))
        self._latency = Histogram("epd_handle_seconds", "Handler latency, by message type",
                                  [*labels, "type"], buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_depth = gauge("epd_queue_depth", "Inbound messages waiting for a handler")
        self.in_flight = gauge("epd_in_flight", "Work items being handled")
        self.state = gauge("epd_state", "0 starting, 1 running, 2 draining, 3 stopped")
        self.peers_alive = gauge("epd_peers_alive", "Registered peers that heartbeat")

        self._children: dict[tuple, object] = {}   # labels() costs microseconds: look each child up once

    def _child(self, metric, key: str, value: str):
        child = self._children.get((id(metric), value))
        if child is None:
            child = self._children[(id(metric), value)] = metric.labels(**self._labels, **{key: value})
        return child

    def received(self, type_name: str) -> None:
        self._child(self._in, "type", type_name).inc()

    def sent(self, type_name: str) -> None:
        self._child(self._out, "type", type_name).inc()

    def error(self, code: str) -> None:
        self._child(self._errors, "code", code).inc()

    def observe(self, type_name: str, seconds: float) -> None:
        self._child(self._latency, "type", type_name).observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
