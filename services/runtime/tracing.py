"""W3C trace context (traceparent) for spans across services."""
from __future__ import annotations

import re
from dataclasses import dataclass

from messages.envelope import random_hex

_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


@dataclass(frozen=True, slots=True)
class SpanContext:
    trace_id: str
    span_id: str
    parent_span_id: str = ""

    @property
    def traceparent(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-01"

    def child(self) -> "SpanContext":
        return SpanContext(self.trace_id, random_hex(64), self.span_id)


def new_trace() -> SpanContext:
    return SpanContext(random_hex(128), random_hex(64))


def span_from(traceparent: str) -> SpanContext:
    """A new span, child of `traceparent`; a new trace when it is absent or invalid."""
    match = _TRACEPARENT.match(traceparent or "")
    if not match or match.group(1) == "0" * 32:
        return new_trace()
    return SpanContext(match.group(1), random_hex(64), match.group(2))
