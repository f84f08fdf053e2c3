"""`epd trace REQUEST_ID`: one request's path across services, rebuilt from the logs alone.

Reads JSON log lines (a run directory, log files, or `docker compose logs` on stdin), keeps the
lines of one request (its request_id, or its trace_id), and prints a timeline plus the tree of
spans: each `request.summary` line is one span, placed under the span that sent the request
(by parent_span_id, else by the sending instance); a streamed answer's summary (chunk count, token
times, chunk gaps) adds first- and last-token rows. `--chrome FILE` writes the same as Chrome
trace-event JSON for ui.perfetto.dev (chrome.py); the command is command.py. Pure
functions of lines.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Iterable

SUMMARY = "request.summary"
STANDARD_KEYS = frozenset({"ts", "level", "event", "service", "instance", "request_id", "trace_id",
                           "span_id", "parent_span_id"})
SUMMARY_KEYS = frozenset({"start", "handle_ms", "queue_ms", "wire_ms", "type", "sender", "outcome",
                          "phases"})
STREAM_KEYS = ("chunks", "first_token_ms", "last_token_ms", "gap_p50_ms", "gap_max_ms")   # ms from start
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_DECODER = json.JSONDecoder()
DETAIL_WIDTH = 120


class TraceSourceError(Exception):
    """A log source named on the command line cannot be read."""


@dataclass(frozen=True, slots=True)
class Span:
    """One service's handling of one message of the request (one request.summary line)."""

    instance: str
    service: str
    type: str
    sender: str
    span_id: str
    parent_span_id: str
    start: float            # epoch seconds, handling began
    handle_ms: float
    queue_ms: float
    wire_ms: float
    outcome: str
    phases: dict[str, float] = field(default_factory=dict)
    stream: dict[str, float] = field(default_factory=dict)   # STREAM_KEYS present in the line

    @property
    def arrived(self) -> float:
        return self.start - self.queue_ms / 1e3

    @property
    def end(self) -> float:
        return self.start + self.handle_ms / 1e3

    def token_marks(self) -> list[tuple[float, str, str]]:
        """(epoch time, event, details) of a streamed answer's first and last token."""
        st = self.stream
        if "first_token_ms" not in st:
            return []
        last = (f"{int(st.get('chunks', 0))} chunks, gap p50={_ms(st.get('gap_p50_ms', 0.0))}ms "
                f"max={_ms(st.get('gap_max_ms', 0.0))}ms")
        return [(self.start + st["first_token_ms"] / 1e3, "stream.first_token", "first token"),
                (self.start + st.get("last_token_ms", st["first_token_ms"]) / 1e3, "stream.last_token", last)]


@dataclass(frozen=True, slots=True)
class Hop:
    """A span in the tree: its depth and how its parent was found ("span", "sender" or "")."""

    span: Span
    depth: int
    parent: Span | None
    linked_by: str


@dataclass
class Trace:
    key: str
    records: list[dict]     # the request's log lines, sorted by ts
    spans: list[Span]       # sorted by arrival
    lines_read: int = 0
    lines_skipped: int = 0  # not a JSON object with a numeric ts

    @property
    def t0(self) -> float:
        """The first moment in the logs: the earliest line or span arrival."""
        return min([r["ts"] for r in self.records] + [s.arrived for s in self.spans], default=0.0)


# ---- parsing ---------------------------------------------------------------------------------
def parse_line(line: str) -> dict | None:
    """One log record, or None when the line holds no JSON object with a numeric `ts`.

    Text before the first `{` (a `docker compose logs` prefix like `router-1  | `) is skipped;
    its service name stands in for a missing `instance`."""
    line = _ANSI.sub("", line)
    brace = line.find("{")
    if brace < 0:
        return None
    try:
        record, _ = _DECODER.raw_decode(line, brace)
    except ValueError:
        return None
    if not isinstance(record, dict) or not _is_number(record.get("ts")):
        return None
    prefix = line[:brace].split("|", 1)[0].strip()
    if prefix and not record.get("instance"):
        record["instance"] = prefix
    return record


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _num(value, default: float = 0.0) -> float:
    return float(value) if _is_number(value) else default


def matches(record: dict, key: str) -> bool:
    """A line of request `key`: its id, a resumed attempt's (`key#r1`, services/gateway/resume.py), or its trace."""
    rid = record.get("request_id")
    return rid == key or record.get("trace_id") == key or (isinstance(rid, str) and rid.startswith(key + "#r"))


def span_of(record: dict) -> Span | None:
    """The span a request.summary line describes; None for other lines."""
    if record.get("event") != SUMMARY:
        return None
    phases = {k: float(v) for k, v in record.items()
              if k.endswith("_ms") and k not in SUMMARY_KEYS and k not in STREAM_KEYS and _is_number(v)}
    if isinstance(record.get("phases"), dict):
        phases.update({str(k): float(v) for k, v in record["phases"].items() if _is_number(v)})
    handle_ms = _num(record.get("handle_ms"))
    return Span(
        instance=str(record.get("instance", "?")), service=str(record.get("service", "")),
        type=str(record.get("type", "")), sender=str(record.get("sender", "")),
        span_id=str(record.get("span_id", "")), parent_span_id=str(record.get("parent_span_id", "")),
        start=_num(record.get("start"), record["ts"] - handle_ms / 1e3), handle_ms=handle_ms,
        queue_ms=_num(record.get("queue_ms")), wire_ms=_num(record.get("wire_ms")),
        outcome=str(record.get("outcome", "")), phases=phases,
        stream={k: float(record[k]) for k in STREAM_KEYS if _is_number(record.get(k))})


def read_trace(lines: Iterable[str], key: str) -> Trace:
    """The lines of request `key` (a request_id or trace_id) among `lines`, with their spans."""
    records, read, skipped = [], 0, 0
    for line in lines:
        read += 1
        record = parse_line(line)
        if record is None:
            skipped += 1 if line.strip() else 0
        elif matches(record, key):
            records.append(record)
    records.sort(key=lambda r: r["ts"])
    spans = sorted((s for s in map(span_of, records) if s is not None), key=lambda s: s.arrived)
    return Trace(key, records, spans, read, skipped)


# ---- the tree of hops ------------------------------------------------------------------------
def parent_of(span: Span, spans: list[Span]) -> tuple[Span | None, str]:
    """The span that sent this one's request: by parent_span_id, else the latest span of the
    sending instance that arrived before it."""
    if span.parent_span_id:
        for other in spans:
            if other is not span and other.span_id == span.parent_span_id:
                return other, "span"
    earlier = [o for o in spans if o is not span and o.instance == span.sender and o.arrived <= span.arrived]
    if earlier:
        return max(earlier, key=lambda o: o.arrived), "sender"
    return None, ""


def span_tree(spans: list[Span]) -> list[Hop]:
    """Spans in depth-first order, children (by arrival) right after their parent."""
    links = {id(s): parent_of(s, spans) for s in spans}
    children: dict[int, list[Span]] = {}
    for span in spans:
        parent = links[id(span)][0]
        if parent is not None:
            children.setdefault(id(parent), []).append(span)
    hops: list[Hop] = []
    seen: set[int] = set()

    def visit(span: Span, depth: int) -> None:
        if id(span) in seen:
            return
        seen.add(id(span))
        parent, linked_by = links[id(span)]
        hops.append(Hop(span, depth, parent if depth else None, linked_by if depth else ""))
        for child in children.get(id(span), []):
            visit(child, depth + 1)

    for span in spans:       # roots first, then whatever a broken parent chain left out
        if links[id(span)][0] is None:
            visit(span, 0)
    for span in spans:
        visit(span, 0)
    return hops


# ---- text ------------------------------------------------------------------------------------
def _ms(value: float) -> str:
    return f"{value:.3f}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _value(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str, separators=(",", ":"))


def details(record: dict) -> str:
    """The key facts of one line: timings for a summary, the non-standard fields otherwise."""
    span = span_of(record)
    if span is not None:
        parts = [span.type, f"from={span.sender or '-'}", f"handle={_ms(span.handle_ms)}ms",
                 f"queue={_ms(span.queue_ms)}ms", f"wire={_ms(span.wire_ms)}ms"]
        if isinstance(record.get("traffic_class"), str):   # the gateway's: which KV store TTL the request got
            parts.insert(1, f"class={record['traffic_class']}")
        parts += [f"{name}={_ms(ms)}ms" for name, ms in span.phases.items()]
        parts += [_stream_text(span)] if span.stream else []
        parts.append(f"outcome={span.outcome}")
    else:
        parts = [f"{k}={_value(v)}" for k, v in record.items() if k not in STANDARD_KEYS]
    level = record.get("level", "info")
    text = " ".join(([f"[{level}]"] if level not in ("info", "debug") else []) + parts)
    return text if len(text) <= DETAIL_WIDTH else text[:DETAIL_WIDTH - 3] + "..."


def _stream_text(span: Span) -> str:   # chunks=64 first_token=12.000ms ... gap_max=3.000ms
    return " ".join(f"{k.removesuffix('_ms')}={int(v) if k == 'chunks' else _ms(v) + 'ms'}"
                    for k, v in span.stream.items())


def timeline_rows(trace: Trace) -> list[tuple[str, str, str, str]]:
    """The request's lines and each streamed answer's first- and last-token rows, in time order."""
    t0 = trace.t0
    rows = [(r["ts"], str(r.get("instance", "?")), str(r.get("event", "")), details(r)) for r in trace.records]
    rows += [(at, s.instance, event, text) for s in trace.spans for at, event, text in s.token_marks()]
    return [(_ms((at - t0) * 1e3), instance, event, text)
            for at, instance, event, text in sorted(rows, key=lambda row: row[0])]


def render(trace: Trace) -> str:
    """The timeline and the span tree as text."""
    t0 = trace.t0
    instances = sorted({str(r.get("instance", "?")) for r in trace.records})
    last = max(r["ts"] for r in trace.records)
    out = [f"request {trace.key}: {_count(len(trace.records), 'log line')} from "
           f"{_count(len(instances), 'instance')} "
           f"({', '.join(instances)}), {_ms((last - t0) * 1e3)} ms from first to last", ""]
    rows = [("offset_ms", "instance", "event", "details")] + timeline_rows(trace)
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        out.append(f"  {row[0]:>{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:<{widths[2]}}  {row[3]}".rstrip())
    out.append("")
    if not trace.spans:
        out.append("no request.summary lines: no spans to show")
        return "\n".join(out)
    out.append("spans (start offset, time queued, time handled; a hop sits under the span that sent it):")
    for hop in span_tree(trace.spans):
        s = hop.span
        label = f"{s.instance} ({s.service})" if s.service else s.instance
        link = (f"  <- {hop.parent.instance} by {hop.linked_by}" if hop.parent else
                f"  <- {s.sender or '?'} (parent span {s.parent_span_id} not in these logs)" if s.parent_span_id else "")
        phases = "".join(f" {k}={_ms(v)}" for k, v in s.phases.items())
        phases += f" {_stream_text(s)}" if s.stream else ""
        out.append(f"  {'  ' * hop.depth}+{_ms((s.start - t0) * 1e3)} ms  {label}  {s.type}  "
                   f"queue {_ms(s.queue_ms)} ms  handle {_ms(s.handle_ms)} ms{phases}  {s.outcome}  "
                   f"span {s.span_id or '-'}{link}")
    return "\n".join(out)
