"""W3C trace context (traceparent) for spans across services."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

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
        return SpanContext(self.trace_id, os.urandom(8).hex(), self.span_id)


def new_trace() -> SpanContext:
    return SpanContext(os.urandom(16).hex(), os.urandom(8).hex())


def span_from(traceparent: str) -> SpanContext:
    """A new span, child of `traceparent`; a new trace when it is absent or invalid."""
    match = _TRACEPARENT.match(traceparent or "")
    if not match or match.group(1) == "0" * 32:
        return new_trace()
    return SpanContext(match.group(1), os.urandom(8).hex(), match.group(2))
