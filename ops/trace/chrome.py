"""`epd trace --chrome FILE`: one request's trace as Chrome trace-event JSON (ui.perfetto.dev).

A process per instance, an "X" slice per span (and one for its queue wait), an "i" instant per
other log line and per streamed answer's first and last token, and a flow arrow from each parent
span to its child. A pure function of a `Trace` (ops/trace/timeline.py).
"""
from __future__ import annotations

from ops.trace.timeline import SUMMARY, Trace, span_tree


def chrome_trace(trace: Trace) -> dict:
    """The trace-event JSON object (`traceEvents`, `displayTimeUnit`, `otherData`)."""
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
                                "queue_ms": span.queue_ms, **{f"phase.{k}": v for k, v in span.phases.items()},
                                **{f"stream.{k}": v for k, v in span.stream.items()}}})
        for at, event, text in span.token_marks():
            events.append({"ph": "i", "s": "t", "name": event, "cat": "stream", "pid": pid, "tid": tid,
                           "ts": us(at), "args": {"details": text}})
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
