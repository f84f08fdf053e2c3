"""A request's traffic class (messages.common.TrafficClass): how long the KV store keeps its blocks
(kvstore/settings.py: agent traffic 3 days, chatbot traffic 7 days by default).

The client names it in the `x-epd-traffic-class` header or in the body's `metadata.traffic_class`:
"agent" or "chatbot". Otherwise it is inferred: a request that carries tools is agent traffic, one
without is chatbot traffic. Any other value, or a header and a body that disagree, is a 400.
"""
from __future__ import annotations

from messages.common import TrafficClass
from services.gateway.adapter.errors import invalid_request

HEADER = "x-epd-traffic-class"
METADATA_PARAM = "metadata.traffic_class"
_NAMES = {c.name.lower(): c for c in TrafficClass}


def named_class(value, where: str) -> TrafficClass:
    """The class a client named; 400 naming `where` for anything else."""
    if isinstance(value, str) and value.strip().lower() in _NAMES:
        return _NAMES[value.strip().lower()]
    raise invalid_request(f"{where}: unknown traffic class {value!r}; expected one of {', '.join(_NAMES)}",
                          param=where, code="invalid_traffic_class")


def header_class(value: str | None) -> TrafficClass | None:
    """The header's class; None when the request sends no header."""
    return None if value is None else named_class(value, HEADER)


def body_class(payload: dict | None, has_tools: bool) -> tuple[TrafficClass, bool]:
    """(class, whether the body named it) from metadata, else inferred from the tools."""
    metadata = payload.get("metadata") if payload is not None else None
    if isinstance(metadata, dict) and "traffic_class" in metadata:
        return named_class(metadata["traffic_class"], METADATA_PARAM), True
    return (TrafficClass.AGENT if has_tools else TrafficClass.CHATBOT), False


def resolved_class(header: TrafficClass | None, body: TrafficClass, body_named: bool) -> TrafficClass:
    """The header's class wins over an inferred one; a header and a body naming two classes are refused."""
    if header is None:
        return body
    if body_named and body != header:
        raise invalid_request(f"{HEADER} says {header.name.lower()} but {METADATA_PARAM} says {body.name.lower()}",
                              param=METADATA_PARAM, code="invalid_traffic_class")
    return header
