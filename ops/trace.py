"""`epd trace REQUEST_ID`: one request's path across services, rebuilt from the logs alone.

Reads JSON log lines (a run directory, log files, or `docker compose logs` on stdin), keeps the
lines of one request (its request_id, or its trace_id), and prints a timeline plus the tree of
spans: each `request.summary` line is one span, placed under the span that sent the request
(by parent_span_id, else by the sending instance). `--chrome FILE` writes the same as
Chrome trace-event JSON for ui.perfetto.dev. Everything but `run` is a pure function of lines.
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

SUMMARY = "request.summary"
STANDARD_KEYS = frozenset({"ts", "level", "event", "service", "instance", "request_id", "trace_id",
                           "span_id", "parent_span_id"})
SUMMARY_KEYS = frozenset({"start", "handle_ms", "queue_ms", "wire_ms", "type", "sender", "outcome",
                          "phases"})
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

    @property
    def arrived(self) -> float:
        return self.start - self.queue_ms / 1e3

    @property
    def end(self) -> float:
        return self.start + self.handle_ms / 1e3


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
    return record.get("request_id") == key or record.get("trace_id") == key


def span_of(record: dict) -> Span | None:
    """The span a request.summary line describes; None for other lines."""
    if record.get("event") != SUMMARY:
        return None
    phases = {k: float(v) for k, v in record.items()
              if k.endswith("_ms") and k not in SUMMARY_KEYS and _is_number(v)}
    if isinstance(record.get("phases"), dict):
        phases.update({str(k): float(v) for k, v in record["phases"].items() if _is_number(v)})
    handle_ms = _num(record.get("handle_ms"))
    return Span(
        instance=str(record.get("instance", "?")), service=str(record.get("service", "")),
        type=str(record.get("type", "")), sender=str(record.get("sender", "")),
        span_id=str(record.get("span_id", "")), parent_span_id=str(record.get("parent_span_id", "")),
        start=_num(record.get("start"), record["ts"] - handle_ms / 1e3), handle_ms=handle_ms,
        queue_ms=_num(record.get("queue_ms")), wire_ms=_num(record.get("wire_ms")),
        outcome=str(record.get("outcome", "")), phases=phases)


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
        parts += [f"{name}={_ms(ms)}ms" for name, ms in span.phases.items()]
        parts.append(f"outcome={span.outcome}")
    else:
        parts = [f"{k}={_value(v)}" for k, v in record.items() if k not in STANDARD_KEYS]
    level = record.get("level", "info")
    text = " ".join(([f"[{level}]"] if level not in ("info", "debug") else []) + parts)
    return text if len(text) <= DETAIL_WIDTH else text[:DETAIL_WIDTH - 3] + "..."


def timeline_rows(trace: Trace) -> list[tuple[str, str, str, str]]:
    t0 = trace.t0
    return [(_ms((r["ts"] - t0) * 1e3), str(r.get("instance", "?")), str(r.get("event", "")), details(r))
            for r in trace.records]


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
        out.append(f"  {'  ' * hop.depth}+{_ms((s.start - t0) * 1e3)} ms  {label}  {s.type}  "
                   f"queue {_ms(s.queue_ms)} ms  handle {_ms(s.handle_ms)} ms{phases}  {s.outcome}  "
                   f"span {s.span_id or '-'}{link}")
    return "\n".join(out)


# ---- Chrome / Perfetto trace events ----------------------------------------------------------
def chrome_trace(trace: Trace) -> dict:
    """Trace-event JSON: a process per instance, an "X" slice per span (and one for its queue
    wait), an "i" instant per other line, and a flow arrow from each parent span to its child."""
    t0 = trace.t0
    us = lambda t: round((t - t0) * 1e6, 3)  # noqa: E731
    pids: dict[str, int] = {}
    events: list[dict] = []
    for record in trace.records:
        instance = str(record.get("instance", "?"))
        if instance not in pids:
            pids[instance] = len(pids) + 1
            service = record.get("service", "")
            events.append({"ph": "M", "name": "process_name", "pid": pids[instance], "tid": 0,
                           "args": {"name": f"{instance} ({service})" if service else instance}})
    tids: dict[int, int] = {}          # id(span) -> its own track, so overlapping spans never clash
    per_instance: dict[str, int] = {}
    for span in trace.spans:
        tid = per_instance[span.instance] = per_instance.get(span.instance, 0) + 1
        tids[id(span)] = tid
        pid = pids[span.instance]
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                       "args": {"name": f"{span.type} span {span.span_id}"}})
        if span.queue_ms > 0:
            events.append({"ph": "X", "name": "queued", "cat": "queue", "pid": pid, "tid": tid,
                           "ts": us(span.arrived), "dur": round(span.queue_ms * 1e3, 3)})
        events.append({"ph": "X", "name": span.type or SUMMARY, "cat": span.service or "span", "pid": pid,
                       "tid": tid, "ts": us(span.start), "dur": round(span.handle_ms * 1e3, 3),
                       "args": {"span_id": span.span_id, "parent_span_id": span.parent_span_id,
                                "sender": span.sender, "outcome": span.outcome, "wire_ms": span.wire_ms,
                                "queue_ms": span.queue_ms, **{f"phase.{k}": v for k, v in span.phases.items()}}})
    by_span_id = {s.span_id: tids[id(s)] for s in trace.spans if s.span_id}
    for record in trace.records:
        if record.get("event") == SUMMARY:
            continue
        events.append({"ph": "i", "s": "t", "name": str(record.get("event", "")), "cat": "log",
                       "pid": pids[str(record.get("instance", "?"))],
                       "tid": by_span_id.get(record.get("span_id"), 0), "ts": us(record["ts"]),
                       "args": {k: v for k, v in record.items() if k not in ("ts", "event")}})
    for flow_id, hop in enumerate((h for h in span_tree(trace.spans) if h.parent), start=1):
        parent, child = hop.parent, hop.span
        sent = min(max(child.arrived - child.wire_ms / 1e3, parent.start), parent.end)
        common = {"name": "hop", "cat": "flow", "id": flow_id}
        events.append({**common, "ph": "s", "pid": pids[parent.instance], "tid": tids[id(parent)], "ts": us(sent)})
        events.append({**common, "ph": "f", "bp": "e", "pid": pids[child.instance], "tid": tids[id(child)],
                       "ts": us(child.start)})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"request": trace.key, "t0_epoch_s": t0}}


# ---- sources and the command -----------------------------------------------------------------
def resolve_sources(sources: list[str], run_dir: str | None) -> list[str | Path]:
    """Paths of the log files to read ("-" is stdin); a directory means its logs/*.log or *.log."""
    names = list(sources) + ([run_dir] if run_dir else [])
    if not names:
        from ops.stack_commands import current_run_dir
        current = current_run_dir()
        if not current.exists():
            raise TraceSourceError(f"no sources given and no current run at {current} "
                                   "(name log files, a run directory, or - for stdin)")
        names = [str(current)]
    paths: list[str | Path] = []
    for name in names:
        if name == "-":
            paths.append("-")
            continue
        path = Path(name)
        if path.is_dir():
            logs = path / "logs" if (path / "logs").is_dir() else path
            found = sorted(logs.glob("*.log"))
            if not found:
                raise TraceSourceError(f"no *.log files in {logs}")
            paths.extend(found)
        elif path.is_file():
            paths.append(path)
        else:
            raise TraceSourceError(f"{name}: no such file or directory")
    return paths


def iter_lines(paths: list[str | Path], stdin=None) -> Iterator[str]:
    for path in paths:
        if path == "-":
            yield from stdin or sys.stdin
            continue
        try:
            with open(path, encoding="utf-8", errors="replace") as handle:
                yield from handle
        except OSError as exc:
            raise TraceSourceError(f"{path}: {exc.strerror or exc}") from None


def run(args) -> int:
    try:
        trace = read_trace(iter_lines(resolve_sources(args.sources, args.run_dir)), args.request_id)
    except TraceSourceError as exc:
        print(f"epd trace: {exc}", file=sys.stderr)
        return 2
    if not trace.records:
        print(f"no log line matches request {args.request_id!r} (read {trace.lines_read} lines, "
              f"{trace.lines_skipped} of them not JSON log records)")
        return 1
    print(render(trace))
    if args.chrome:
        try:
            Path(args.chrome).write_text(json.dumps(chrome_trace(trace), default=str))
        except OSError as exc:
            print(f"epd trace: cannot write {args.chrome}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        print(f"\nwrote {args.chrome}: open it at https://ui.perfetto.dev")
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("trace", help="show one request's path across services, from the logs")
    parser.add_argument("request_id", metavar="REQUEST_ID", help="a request id (or trace id)")
    parser.add_argument("sources", nargs="*", metavar="SOURCE",
                        help="log files, run directories, or - for stdin (docker compose logs); "
                             "default: the current run (.epd/runs/current, or $EPD_RUN_ROOT/current)")
    parser.add_argument("--run-dir", help="a run directory whose logs/*.log to read")
    parser.add_argument("--chrome", metavar="FILE", help="also write Chrome/Perfetto trace-event JSON here")
    parser.set_defaults(func=run)
