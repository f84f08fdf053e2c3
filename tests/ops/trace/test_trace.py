"""`epd trace`: a request's path rebuilt from log lines of several services."""
from __future__ import annotations

import argparse
import io
import json

import pytest

from ops.trace import chrome as trace_chrome, command as trace_command, timeline as trace

T0 = 1_700_000_000.0
TRACE_ID = "ab" * 16
GW_SPAN, ROUTER_SPAN, WORKER_SPAN = "1" * 16, "2" * 16, "3" * 16


def _line(ts_ms: float, instance: str, service: str, event: str, **fields) -> str:
    record = {"ts": T0 + ts_ms / 1e3, "level": "info", "event": event, "service": service,
              "instance": instance, **fields}
    return json.dumps(record)


def _request(span: str, parent: str = "", request_id: str = "req-1", trace_id: str = TRACE_ID) -> dict:
    fields = {"request_id": request_id, "trace_id": trace_id, "span_id": span}
    if parent:
        fields["parent_span_id"] = parent
    return fields


def _summary(end_ms: float, instance: str, service: str, type_: str, sender: str, start_ms: float,
             handle_ms: float, queue_ms: float, span: str, parent: str = "", **extra) -> str:
    return _line(end_ms, instance, service, "request.summary", type=type_, sender=sender,
                 start=T0 + start_ms / 1e3, handle_ms=handle_ms, queue_ms=queue_ms, wire_ms=0.2,
                 outcome="ok", **_request(span, parent), **extra)


def sample_lines() -> list[str]:
    """Three instances (gateway -> router -> worker), one request, plus noise around it."""
    gw = [
        _line(0.0, "gw-1", "gateway", "http.request", path="/v1/generate", **_request(GW_SPAN)),
        _summary(10.0, "gw-1", "gateway", "Generate", "client", 0.5, 9.5, 0.5, GW_SPAN),
        _line(3.0, "gw-1", "gateway", "service.ready", bind="tcp://*:1"),                  # no request
        _line(4.0, "gw-1", "gateway", "http.request", **_request("9" * 16, request_id="req-2", trace_id="cd" * 16)),
    ]
    router = [
        "router-1  | " + _line(1.0, "router-1", "router", "route.chosen", worker="worker-1",
                               **_request(ROUTER_SPAN, GW_SPAN)),
        "router-1  | " + _summary(8.0, "router-1", "router", "Route", "gw-1", 1.0, 7.0, 0.1,
                                  ROUTER_SPAN, GW_SPAN),
        "router-1  | Traceback (most recent call last):",                                   # garbage
        "\x1b[36mrouter-1  |\x1b[0m not json at all {oops",                               # garbage
    ]
    worker = [
        _summary(7.0, "worker-1", "decode_worker", "Decode", "router-1", 2.5, 4.0, 0.4, WORKER_SPAN,
                 ROUTER_SPAN, prefill_ms=1.5, phases={"sample": 0.25}),
        _line(5.0, "worker-1", "decode_worker", "kv.pages_allocated", level="debug", pages=12,
              **_request(WORKER_SPAN, ROUTER_SPAN)),
        "",
        "[1, 2, 3]",                                                                      # JSON, no object
        '{"event": "no ts", "request_id": "req-1"}',                                     # no numeric ts
    ]
    return gw + router + worker


def test_parse_line_skips_compose_prefix_and_rejects_garbage():
    record = trace.parse_line('swa_registry-1  | {"ts": 1.5, "event": "x", "instance": "swa-0"}')
    assert record == {"ts": 1.5, "event": "x", "instance": "swa-0"}
    assert trace.parse_line('swa_registry-1  | {"ts": 1.5, "event": "x"}')["instance"] == "swa_registry-1"
    for garbage in ("", "plain text", "{not json", "[1, 2]", '{"ts": "yesterday"}', '{"ts": true}'):
        assert trace.parse_line(garbage) is None


def test_read_trace_keeps_only_the_request_sorted_by_time():
    result = trace.read_trace(sample_lines(), "req-1")
    events = [(r["instance"], r["event"]) for r in result.records]
    assert events == [
        ("gw-1", "http.request"), ("router-1", "route.chosen"), ("worker-1", "kv.pages_allocated"),
        ("worker-1", "request.summary"), ("router-1", "request.summary"), ("gw-1", "request.summary")]
    assert [s.instance for s in result.spans] == ["gw-1", "router-1", "worker-1"]
    assert result.lines_skipped == 4          # two garbage lines, a JSON array, an object without ts
    assert result.t0 == pytest.approx(T0)


def test_trace_id_selects_the_same_lines_as_request_id():
    by_request = trace.read_trace(sample_lines(), "req-1").records
    assert trace.read_trace(sample_lines(), TRACE_ID).records == by_request


def test_span_tree_nests_hops_by_parent_span_id():
    hops = trace.span_tree(trace.read_trace(sample_lines(), "req-1").spans)
    assert [(h.span.instance, h.depth, h.linked_by) for h in hops] == [
        ("gw-1", 0, ""), ("router-1", 1, "span"), ("worker-1", 2, "span")]


def test_span_tree_falls_back_to_the_sending_instance():
    lines = [_summary(5.0, "a", "svc", "Ping", "client", 0.0, 5.0, 0.0, "a" * 16),
             _summary(4.0, "b", "svc", "Ping", "a", 1.0, 3.0, 0.0, "b" * 16, parent="f" * 16)]
    hops = trace.span_tree(trace.read_trace(lines, "req-1").spans)
    assert [(h.span.instance, h.depth, h.linked_by) for h in hops] == [("a", 0, ""), ("b", 1, "sender")]


def test_span_tree_survives_a_parent_cycle():
    lines = [_summary(5.0, "a", "svc", "Ping", "b", 0.0, 5.0, 0.0, "a" * 16, parent="b" * 16),
             _summary(4.0, "b", "svc", "Ping", "a", 1.0, 3.0, 0.0, "b" * 16, parent="a" * 16)]
    hops = trace.span_tree(trace.read_trace(lines, "req-1").spans)
    assert sorted(h.span.instance for h in hops) == ["a", "b"]


def test_span_collects_phase_timings():
    worker = next(s for s in trace.read_trace(sample_lines(), "req-1").spans if s.instance == "worker-1")
    assert worker.phases == {"prefill_ms": 1.5, "sample": 0.25}
    assert worker.arrived == pytest.approx(T0 + 2.1e-3)


def test_render_shows_timeline_offsets_and_indented_tree():
    text = trace.render(trace.read_trace(sample_lines(), "req-1"))
    assert "request req-1: 6 log lines from 3 instances (gw-1, router-1, worker-1)" in text
    timeline = [line for line in text.splitlines() if "route.chosen" in line][0]
    assert timeline.split()[:3] == ["1.000", "router-1", "route.chosen"]
    assert "worker=worker-1" in timeline
    summary_row = [line for line in text.splitlines() if "request.summary" in line and "worker-1" in line][0]
    assert "Decode from=router-1 handle=4.000ms queue=0.400ms" in summary_row and "prefill_ms=1.500ms" in summary_row
    tree = text.split("spans (")[1].splitlines()[1:]
    assert tree[0].startswith("  +0.500 ms  gw-1 (gateway)  Generate")
    assert tree[1].startswith("    +1.000 ms  router-1 (router)  Route") and tree[1].endswith("<- gw-1 by span")
    assert tree[2].startswith("      +2.500 ms  worker-1 (decode_worker)  Decode")


def test_chrome_trace_has_slices_processes_instants_and_flows():
    events = trace_chrome.chrome_trace(trace.read_trace(sample_lines(), "req-1"))["traceEvents"]
    json.dumps(events)                                    # serialisable as it is
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"gw-1 (gateway)", "router-1 (router)", "worker-1 (decode_worker)"}
    slices = {e["name"]: e for e in events if e["ph"] == "X" and e["cat"] != "queue"}
    assert set(slices) == {"Generate", "Route", "Decode"}
    assert slices["Decode"]["ts"] == pytest.approx(2500.0, abs=0.5)     # microseconds from the first event
    assert slices["Decode"]["dur"] == pytest.approx(4000.0)
    assert slices["Decode"]["args"]["parent_span_id"] == ROUTER_SPAN
    pids = {e["args"]["name"].split()[0]: e["pid"] for e in events if e["name"] == "process_name"}
    assert slices["Route"]["pid"] == pids["router-1"]
    instants = [e for e in events if e["ph"] == "i"]
    assert sorted(e["name"] for e in instants) == ["http.request", "kv.pages_allocated", "route.chosen"]
    starts = [e for e in events if e["ph"] == "s"]
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    assert len(starts) == 2 and set(ends) == {e["id"] for e in starts}
    for start in starts:                                 # each arrow leaves inside its parent slice
        parent = next(e for e in slices.values() if (e["pid"], e["tid"]) == (start["pid"], start["tid"]))
        assert parent["ts"] <= start["ts"] <= parent["ts"] + parent["dur"]
    worker_flow = next(e for e in ends.values() if e["pid"] == pids["worker-1"])
    assert worker_flow["ts"] == slices["Decode"]["ts"] and worker_flow["bp"] == "e"


def streamed_lines() -> list[str]:
    """The gateway's one summary of a streamed answer: 64 chunks, tokens from 12 ms to 80 ms."""
    return [_line(1.0, "gw-1", "gateway", "http.request", **_request(GW_SPAN)),
            _summary(90.0, "gw-1", "gateway", "chat.completions", "http", 0.0, 90.0, 0.0, GW_SPAN,
                     chunks=64, first_token_ms=12.0, last_token_ms=80.0, gap_p50_ms=1.0, gap_max_ms=6.5,
                     phases={"prepare_ms": 0.5})]


def test_a_streamed_answer_shows_first_and_last_token_chunk_count_and_gaps():
    result = trace.read_trace(streamed_lines(), "req-1")
    [span] = result.spans
    assert span.phases == {"prepare_ms": 0.5}
    assert span.stream == {"chunks": 64, "first_token_ms": 12.0, "last_token_ms": 80.0,
                           "gap_p50_ms": 1.0, "gap_max_ms": 6.5}
    text = trace.render(result)
    assert "request req-1: 2 log lines from 1 instance" in text
    timeline = [line.split(None, 3) for line in text.split("spans (")[0].splitlines()[3:] if line.strip()]
    assert [row[:3] for row in timeline] == [
        ["1.000", "gw-1", "http.request"], ["12.000", "gw-1", "stream.first_token"],
        ["80.000", "gw-1", "stream.last_token"], ["90.000", "gw-1", "request.summary"]]
    assert timeline[2][3] == "64 chunks, gap p50=1.000ms max=6.500ms"
    tree = text.split("spans (")[1].splitlines()[1]
    assert "chunks=64 first_token=12.000ms last_token=80.000ms gap_p50=1.000ms gap_max=6.500ms" in tree
    events = trace_chrome.chrome_trace(result)["traceEvents"]
    marks = {e["name"]: e["ts"] for e in events if e.get("cat") == "stream"}
    assert marks == {"stream.first_token": pytest.approx(12_000.0, abs=0.5),
                     "stream.last_token": pytest.approx(80_000.0, abs=0.5)}


def test_a_summary_without_tokens_has_no_token_rows():
    line = _summary(5.0, "gw-1", "gateway", "chat.completions", "http", 0.0, 5.0, 0.0, GW_SPAN, chunks=0)
    result = trace.read_trace([line], "req-1")
    assert result.spans[0].stream == {"chunks": 0} and "stream.first_token" not in trace.render(result)


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="epd")
    trace_command.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)


def _write_run_dir(root) -> None:
    logs = root / "logs"
    logs.mkdir(parents=True)
    lines = sample_lines()
    (logs / "gw-1.log").write_text("\n".join(lines[:4]) + "\n")
    (logs / "router-1.log").write_text("\n".join(lines[4:8]) + "\n")
    (logs / "worker-1.log").write_text("\n".join(lines[8:]) + "\n")


def test_cli_reads_the_current_run_and_writes_chrome_json(tmp_path, monkeypatch, capsys):
    _write_run_dir(tmp_path / "runs" / "run-1")
    (tmp_path / ".epd" / "runs").mkdir(parents=True)
    (tmp_path / ".epd" / "runs" / "current").symlink_to(tmp_path / "runs" / "run-1")
    monkeypatch.chdir(tmp_path)
    assert _cli(["trace", "req-1", "--chrome", "out.json"]) == 0
    out = capsys.readouterr().out
    assert "3 instances" in out and "wrote out.json" in out
    assert len(json.loads((tmp_path / "out.json").read_text())["traceEvents"]) > 10


def test_cli_reads_compose_logs_from_stdin(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(sample_lines()) + "\n"))
    assert _cli(["trace", "req-1", "-"]) == 0
    assert "router-1 (router)  Route" in capsys.readouterr().out


def test_cli_says_so_when_no_line_matches(tmp_path, capsys):
    _write_run_dir(tmp_path / "run")
    assert _cli(["trace", "req-404", "--run-dir", str(tmp_path / "run")]) == 1
    out = capsys.readouterr().out
    assert "no log line matches request 'req-404'" in out and "4 of them not JSON log records" in out


def test_cli_reports_missing_sources(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert _cli(["trace", "req-1"]) == 2
    assert "no current run" in capsys.readouterr().err
    assert _cli(["trace", "req-1", str(tmp_path / "nope.log")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_epd_trace_with_only_a_request_id_reads_the_current_run(tmp_path, monkeypatch, capsys):
    from ops.cli import main
    _write_run_dir(tmp_path / "runs" / "run-1")
    (tmp_path / "runs" / "current").symlink_to(tmp_path / "runs" / "run-1")
    monkeypatch.setenv("EPD_RUN_ROOT", str(tmp_path / "runs"))
    assert main(["trace", "req-1"]) == 0
    assert "3 instances" in capsys.readouterr().out


def test_epd_trace_without_a_request_id_names_only_request_id_as_missing(capsys):
    from ops.cli import main
    with pytest.raises(SystemExit) as exited:
        main(["trace"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "required: REQUEST_ID" in err and "SOURCE" not in err.splitlines()[-1]


def test_the_gateway_summary_shows_the_requests_traffic_class():
    line = _summary(10.0, "gw-1", "gateway", "chat.completions", "http", 0.5, 9.5, 0.5, GW_SPAN,
                    traffic_class="agent")
    text = trace.render(trace.read_trace([line], "req-1"))
    assert "chat.completions class=agent from=http" in text
