"""structlog set-up: JSON lines on stdout, one configuration per process, called from main().

Every line carries ts (epoch seconds), level, event, service, instance; inside a request the
runtime binds request_id, trace_id, span_id and parent_span_id through contextvars, which is
what `epd trace` reads back.
"""
from __future__ import annotations

import json
import logging
import sys
from contextvars import ContextVar

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


# The request being handled (request_id, trace_id, span_id, parent_span_id): set by the service
# shell around each handler; one ContextVar set/reset is far cheaper than structlog's bind per field.
# Either a dict of those fields or an object whose log_fields() returns it (the shell sets its
# Context: the dict is only built when a line is written).
REQUEST_FIELDS: ContextVar = ContextVar("epd_request_fields", default=None)


def _merge_request_fields(_, __, event_dict):
    fields = REQUEST_FIELDS.get()
    if fields is not None and not isinstance(fields, dict):
        fields = fields.log_fields()
    if fields:
        for key, value in fields.items():
            event_dict.setdefault(key, value)
    return event_dict


def _epoch_ts(_, __, event_dict):
    import time
    event_dict.setdefault("ts", round(time.time(), 6))
    return event_dict


class _CurrentStdout:
    """sys.stdout as it is at each write, not at configuration: whoever swaps stdout later (a
    test's capture, a redirect) gets the lines, and no logger is left writing to a closed stream."""

    def write(self, text: str) -> int:
        return sys.stdout.write(text)

    def flush(self) -> None:
        sys.stdout.flush()


def configure_logging(level: str = "info", stream=None) -> None:
    if level not in _LEVELS:
        raise ValueError(f"log level must be one of {sorted(_LEVELS)}")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _merge_request_fields,
            structlog.processors.add_log_level,
            _epoch_ts,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=lambda obj, **kw: json.dumps(obj, default=str)),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(stream or _CurrentStdout()),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()


def get_logger(**bound):
    return structlog.get_logger().bind(**bound)
