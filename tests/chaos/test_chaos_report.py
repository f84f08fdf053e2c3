"""`epd chaos` without processes: how streamed events become a result, how outputs are compared with
the fault-free run, the table, and the scaled topology the command starts."""
from __future__ import annotations

import tomllib
from importlib import resources

import pytest

from ops.chaos.client import Result, feed_event, longest_gap
from ops.chaos.stack import scaled_topology_text
from ops.chaos.table import Row, compare_output, count_identical, error_cell, format_report, table_rows
from ops.cli import build_parser
from ops.topology import parse_topology


# ---- streamed events -> Result ---------------------------------------------------------------
def test_chat_chunks_gather_text_finish_usage_and_cached_tokens():
    result = Result(0)
    assert feed_event(result, {"choices": [{"delta": {"role": "assistant"}}]}) is False
    assert feed_event(result, {"choices": [{"delta": {"content": "Hel"}}]}) is True
    assert feed_event(result, {"choices": [{"delta": {"content": "lo"}, "finish_reason": "length"}]}) is True
    feed_event(result, {"choices": [], "usage": {"prompt_tokens": 300, "completion_tokens": 2,
                                                  "prompt_tokens_details": {"cached_tokens": 256}}})
    assert (result.text, result.finish, result.prompt_tokens, result.completion_tokens, result.cached_tokens) \
        == ("Hello", "length", 300, 2, 256)
    assert not result.completed          # no [DONE] yet, and no HTTP status


def test_anthropic_events_gather_text_and_end_at_message_stop():
    result = Result(0, "messages", status=200)
    feed_event(result, {"type": "message_start", "message": {"usage": {"input_tokens": 12}}})
    assert feed_event(result, {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "Hi"}})
    feed_event(result, {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 1}})
    assert not result.completed
    feed_event(result, {"type": "message_stop"})
    assert (result.text, result.finish, result.completion_tokens, result.completed) == ("Hi", "max_tokens", 1, True)


@pytest.mark.parametrize("event", [{"error": {"message": "the worker died", "type": "api_error"}},
                                   {"type": "error", "error": {"type": "overloaded_error", "message": "the worker died"}}])
def test_an_error_event_fails_the_stream_with_its_message(event):
    result = Result(0, status=200, done=True)
    feed_event(result, event)
    assert not result.completed and "the worker died" in result.error


def test_the_stall_counts_from_the_send_to_the_end_of_the_stream():
    assert longest_gap([]) == 0.0
    assert Result(0, chunk_times=[0.5, 1.0, 4.5, 5.0], ended_s=5.1).stall_s == pytest.approx(3.5)
    assert Result(0, chunk_times=[], ended_s=60.0).stall_s == pytest.approx(60.0)   # nothing ever came
    assert Result(0, chunk_times=[9.0, 9.1], ended_s=9.2).stall_s == pytest.approx(9.0)   # a slow first chunk


# ---- comparison with the fault-free run -------------------------------------------------------
@pytest.mark.parametrize("got, verdict", [
    ("the cat sat", "identical"),
    ("", "no output"),
    ("the cat", "truncated (7 of 11 chars)"),
    ("the cat sat sat", "extra text after the baseline's 11 chars (duplicated tokens?)"),
    ("the dog sat", "differs at char 4: 'cat sat' vs 'dog sat'"),
])
def test_outputs_compare_by_exact_text(got, verdict):
    assert compare_output("the cat sat", got) == verdict


def test_identical_counts_only_exact_matches_and_names_the_rest():
    same, differences = count_identical(["a b", "c d", "e f"], ["a b", None, "e F"])
    assert same == 1
    assert differences == ["request 1: no output", "request 2: differs at char 2: 'f' vs 'F'"]


# ---- the table -------------------------------------------------------------------------------
def test_error_cell_shows_the_count_and_the_commonest_error():
    assert error_cell([]) == "-"
    assert error_cell(["HTTP 504: timeout"] * 3) == "3: HTTP 504: timeout"
    assert error_cell(["HTTP 502: died", "HTTP 502: died", "reset"]) == "3: HTTP 502: died (x2)"
    assert len(error_cell(["x" * 500])) < 80


def test_rows_render_counts_identical_stall_and_verdict():
    ok = Row("decode_kill", requests=8, completed=8, identical=8, stall_s=2.345)
    bad = Row("kv_writer_kill", requests=8, completed=6, identical=3, compared=4, stall_s=61.0,
              errors=["client deadline: no data in time"] * 2)
    bad.check(False, "2 of 8 did not complete")
    bare = Row("bind_fail", requests=1, completed=1)
    assert table_rows([ok, bad, bare]) == [
        ["decode_kill", 8, 8, "8/8", "2.35", "-", "ok"],
        ["kv_writer_kill", 8, 6, "3/4", "61.00", "2: client deadline: no data in time", "FAIL"],
        ["bind_fail", 1, 1, "n/a", None, "-", "ok"]]
    report = format_report([ok, bad, bare], "title")
    lines = report.splitlines()
    assert lines[0] == "title" and "longest stall s" in lines[1]
    stall_end = lines[1].index("longest stall s") + len("longest stall s")
    assert [line[stall_end - 5:stall_end] for line in lines[3:6]] == [" 2.35", "61.00", "     "]   # right-aligned
    assert "FAILED: 2 of 8 did not complete" in report
    assert bad.as_dict()["ok"] is False and ok.as_dict()["ok"] is True


def test_check_records_only_what_does_not_hold():
    row = Row("storm")
    assert row.check(True, "never shown") and row.ok
    assert not row.check(False, "RSS not back near baseline") and row.failures == ["RSS not back near baseline"]


# ---- the stack it starts ---------------------------------------------------------------------
def test_the_default_topology_is_scaled_to_two_prefill_and_two_decode_workers():
    text = scaled_topology_text((resources.files("ops.topologies") / "default.toml").read_text(), 2)
    topology = parse_topology(tomllib.loads(text))
    instances = [config.instance for _, _, config in topology.instances()]
    assert [i for i in instances if i.startswith(("prefill_worker", "decode_worker"))] == [
        "prefill_worker-0", "prefill_worker-1", "decode_worker-0", "decode_worker-1"]
    assert "vision_worker-0" in instances and "vision_worker-1" not in instances   # the vision pool stays as it is
    assert {s.name for s in topology.services} >= {"gateway", "prefill_router", "decode_router", "kv_writer",
                                                   "swa_registry"}


def test_worker_settings_go_to_each_worker_and_nowhere_else():
    text = scaled_topology_text((resources.files("ops.topologies") / "default.toml").read_text(), 1,
                                {"batch_invariant": True})
    settings = {s["name"]: s.get("settings", {}) for s in tomllib.loads(text)["service"]}
    assert settings["prefill_worker"]["batch_invariant"] is True and settings["decode_worker"]["batch_invariant"] is True
    assert [name for name, values in settings.items() if "batch_invariant" in values] == ["prefill_worker",
                                                                                         "decode_worker"]


def test_the_chaos_command_is_registered_with_its_scenarios():
    args = build_parser().parse_args(["chaos", "--scenario", "decode_kill", "--scenario", "storm", "--json", "x"])
    assert args.scenario == ["decode_kill", "storm"] and args.json == "x"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["chaos", "--scenario", "no_such_scenario"])
