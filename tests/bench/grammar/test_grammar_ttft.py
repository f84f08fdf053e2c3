"""`epd bench grammar --ttft`: the window order, request split and arrivals, the summary's ratios and
verdict, CPU lists and pinning, the topology edit, the compile load against a stand-in compiler
over real ZeroMQ, and (slow) the whole run on a tiny unified stack. No timing asserts."""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import tomllib
from importlib import resources

import pytest
import zmq

from messages import Codec
from messages.errors import ErrorCode, ErrorReply
from messages.grammar import GrammarCompiled
import bench
from bench.grammar.ttft import with_compile_processes
from bench.grammar.ttft_load import SALT, CompileLoad, LoadWindow, heavy_constraint_template
from bench.common.cpu_pinning import (PinPlan, apply, check_cpu_sets, children_of, format_cpu_list, misplaced,
                                      parse_cpu_list, plan_for_stack, tree)
from bench.common.plain_traffic import PlainOutcome, arrivals, split
from bench.grammar.ttft_report import P99_TARGET, Window, summarize, window_order
from tests.helpers.test_helper_stack import pid_alive


def run_bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="epd")
    bench.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "grammar", "--ttft", *argv])
    return args.func(args)


# ---- windows, requests, arrivals ------------------------------------------------------------------
def test_sides_alternate_and_which_one_opens_a_round_alternates_too():
    order = window_order(4)
    assert order == [(0, "baseline"), (0, "loaded"), (1, "loaded"), (1, "baseline"),
                     (2, "baseline"), (2, "loaded"), (3, "loaded"), (3, "baseline")]
    # a linear drift over the run falls on both sides alike: equal mean position
    positions = {side: [i for i, (_, s) in enumerate(order) if s == side] for side in ("baseline", "loaded")}
    assert sum(positions["baseline"]) == sum(positions["loaded"])


def test_requests_spread_over_rounds_as_evenly_as_they_can():
    assert split(10, 3) == [4, 3, 3]
    assert split(90, 3) == [30, 30, 30]
    assert split(3, 3) == [1, 1, 1]


def test_arrivals_are_seeded_poisson_times_at_the_rate():
    first = arrivals(2000, 4.0, random.Random(7))
    assert first == arrivals(2000, 4.0, random.Random(7))
    assert first != arrivals(2000, 4.0, random.Random(8))
    assert first[0] == 0.0 and all(b >= a for a, b in zip(first, first[1:]))
    mean_gap = first[-1] / (len(first) - 1)
    assert 0.9 / 4.0 < mean_gap < 1.1 / 4.0


# ---- the summary ----------------------------------------------------------------------------------
def outcome(side: str, round_: int, index: int, ttft_ms: float, has_text: bool = True) -> PlainOutcome:
    return PlainOutcome(side, round_, index, 0.0, ttft_ms / 1e3, ttft_ms / 1e3, ttft_ms / 1e3 + 0.1, 30, 8, 0,
                        has_text)


def windows_with(scale: float, load: LoadWindow) -> list[Window]:
    """Two rounds of 50 requests; the loaded copy of each request takes `scale` times its baseline TTFT."""
    out = []
    for round_, side in window_order(2):
        factor = scale if side == "loaded" else 1.0
        outcomes = [outcome(side, round_, i, (100 + i + 50 * round_) * factor) for i in range(50)]
        out.append(Window(side, round_, outcomes, 10.0, load if side == "loaded" else None))
    return out


def test_the_summary_takes_nearest_rank_percentiles_and_loaded_over_baseline_ratios():
    load = LoadWindow(sent=5, latencies_s=[0.5, 0.7, 0.6, 0.9], compile_ms=[450.0, 650.0, 550.0, 850.0],
                      errors={"GRAMMAR_TIMEOUT": 1})
    results = summarize(windows_with(1.5, load))
    base, loaded = results["baseline"], results["loaded"]
    # baseline TTFTs are 100..199 ms: p50 = the 51st of 100, p99 = the 100th (nearest rank)
    assert (base["requests"], base["ttft_ms_p50"], base["ttft_ms_p90"], base["ttft_ms_p99"]) == (100, 150, 190, 199)
    assert loaded["ttft_ms_p99"] == pytest.approx(199 * 1.5)
    assert results["ratio"] == {"p50": 1.5, "p90": 1.5, "p99": 1.5} and results["verdict"] == "MISS"
    assert results["added_ttft_ms_p50"] == pytest.approx(75, abs=1)         # per request: loaded - baseline
    # both loaded windows share the one LoadWindow here: its compiles count twice
    assert loaded["compiles_done"] == 8 and loaded["compiles_sent"] == 10
    assert loaded["compile_ms_p50"] == 700 and loaded["compile_service_ms_p50"] == 650
    assert loaded["compile_errors"] == {"GRAMMAR_TIMEOUT": 2} and base["compiles_done"] == 0
    assert [(w["round"], w["side"]) for w in results["per_window"]] == window_order(2)
    assert results["per_window"][1]["p50_vs_baseline"] == 1.5 and "p50_vs_baseline" not in results["per_window"][0]


def test_the_verdict_is_ok_only_below_the_p99_target():
    assert summarize(windows_with(1.0, LoadWindow()))["verdict"] == "ok"
    assert summarize(windows_with(P99_TARGET - 0.01, LoadWindow()))["verdict"] == "ok"
    assert summarize(windows_with(P99_TARGET + 0.01, LoadWindow()))["verdict"] == "MISS"


# ---- CPU lists and pinning ------------------------------------------------------------------------
def test_cpu_lists_parse_fold_and_are_checked():
    assert parse_cpu_list("0-3,6, 9-10") == {0, 1, 2, 3, 6, 9, 10}
    assert format_cpu_list({0, 1, 2, 3, 6, 9, 10}) == "0-3,6,9-10"
    for bad in ("", "a-3", "3-1", "1,,x"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)
    usable = frozenset(range(16))
    assert check_cpu_sets(frozenset(range(8, 16)), frozenset(range(8)), usable) == ""
    assert "share CPUs 7" in check_cpu_sets(frozenset(range(7, 16)), frozenset(range(8)), usable)
    assert "CPUs 16-17 are not usable" in check_cpu_sets(frozenset({16, 17}), frozenset({0}), usable)


def fake_proc(root, parents: dict[int, int]) -> str:
    """A /proc with one stat file per pid (its parent pid in field 4, after a name with a space)."""
    for pid, ppid in parents.items():
        (root / str(pid)).mkdir()
        (root / str(pid) / "stat").write_text(f"{pid} (py thon) S {ppid} 1 1 0 -1\n")
    (root / "self").mkdir()
    return str(root)


def test_the_plan_puts_each_compiler_tree_apart_from_every_other_service(tmp_path):
    # supervisor 10 -> gateway 11, compiler 12 (-> compile processes 13, 14), worker 15 (-> 16)
    proc = fake_proc(tmp_path, {10: 1, 11: 10, 12: 10, 13: 12, 14: 12, 15: 10, 16: 15, 99: 1})
    children = children_of(proc)
    assert sorted(tree(12, children)) == [12, 13, 14] and sorted(tree(10, children)) == [10, 11, 12, 13, 14, 15, 16]
    state = {"supervisor_pid": 10, "services": [{"kind": "gateway", "pid": 11}, {"kind": "grammar_compiler", "pid": 12},
                                                {"kind": "decode_worker", "pid": 15}, {"kind": "kv_writer", "pid": 0}]}
    plan = plan_for_stack(state, frozenset({1}), frozenset({0}), own_pid=99, proc_root=proc)
    assert plan.groups["compiler"][0] == {1} and sorted(plan.groups["compiler"][1]) == [12, 13, 14]
    assert plan.groups["stack"][0] == {0}
    assert sorted(plan.groups["stack"][1]) == [10, 11, 15, 16, 99]


@pytest.mark.slow   # starts a process
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable CPUs")
def test_pinning_moves_every_thread_of_a_process_and_its_children():
    second, mine = sorted(os.sched_getaffinity(0))[1], os.sched_getaffinity(0)
    script = ("import subprocess, sys, threading\n"
              "done = threading.Event()\n"
              "for _ in range(3): threading.Thread(target=done.wait, daemon=True).start()\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'],\n"
              "                         stdin=subprocess.PIPE)\n"
              "print(child.pid, flush=True)\n"
              "sys.stdin.read(); child.stdin.close(); child.wait()\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        pids = tree(parent.pid, children_of())
        assert child in pids
        plan = PinPlan({"compiler": (frozenset({second}), pids)})
        threads = apply(plan)
        assert threads["compiler"] >= 5 and misplaced(plan) == []           # 4 threads of the parent, 1+ of the child
        for pid in pids:
            for tid in os.listdir(f"/proc/{pid}/task"):
                assert os.sched_getaffinity(int(tid)) == {second}
        assert os.sched_getaffinity(0) == mine                              # this process untouched
    finally:
        parent.stdin.close()
        parent.wait(timeout=10)


# ---- the topology edit ----------------------------------------------------------------------------
def test_compile_processes_are_set_in_the_compilers_settings_and_nowhere_else():
    text = (resources.files("ops.topologies") / "default.toml").read_text()
    edited = tomllib.loads(with_compile_processes(text, 6))
    original = tomllib.loads(text)
    for before, after in zip(original["service"], edited["service"]):
        if after["kind"] == "grammar_compiler":
            assert after["settings"] == {**before["settings"], "processes": 6}
        else:
            assert after == before
    again = tomllib.loads(with_compile_processes(with_compile_processes(text, 6), 3))
    assert [s["settings"]["processes"] for s in again["service"] if s["kind"] == "grammar_compiler"] == [3]
    without = '[[service]]\nname = "gateway"\nkind = "gateway"\n'
    with pytest.raises(ValueError, match="no grammar_compiler"):
        with_compile_processes(without, 2)


# ---- the compile load -----------------------------------------------------------------------------
def test_every_salted_constraint_is_a_distinct_closed_object_of_required_properties():
    template = heavy_constraint_template(5)
    first, second = (json.loads(template.replace(SALT, salt)) for salt in ("sA1", "sA2"))
    schema = first["schema"]
    assert first["kind"] == "json_schema" and first["strict"] is True
    assert schema["required"] == list(schema["properties"]) == [f"sA1_{i}" for i in range(5)]
    assert schema["additionalProperties"] is False and first != second


class BatchingCompilerForTest:
    """A ROUTER on a thread that answers GrammarCompile requests `batch` at a time, every third with
    ErrorReply GRAMMAR_TIMEOUT; once `flush` is set it answers whatever it holds (a stopping load
    sends no more). `answered` is set when `enough` have been answered."""

    def __init__(self, batch: int, enough: int):
        self.batch, self.enough = batch, enough
        self.batches: list[int] = []
        self.constraints: list[str] = []
        self.answered, self.flush, self.stopping = threading.Event(), threading.Event(), threading.Event()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        codec, held = Codec(sender="batching-compiler-for-test"), []
        while not self.stopping.is_set():
            if self.sock.poll(20):   # 20 ms: how soon a flush or a stop is noticed
                identity, *frames = self.sock.recv_multipart()
                held.append((identity, codec.decode(frames)))
            if not held or (len(held) < self.batch and not self.flush.is_set()):
                continue
            self.batches.append(len(held))
            for identity, envelope in held:
                self.constraints.append(envelope.message.constraint)
                reply = (ErrorReply(int(ErrorCode.GRAMMAR_TIMEOUT), "too complex") if len(self.constraints) % 3 == 0
                         else GrammarCompiled("k", "llguidance", "grammar", compile_ms=5.0))
                self.sock.send_multipart([identity, *codec.encode(reply, request_id=envelope.request_id)])
            held = []
            if len(self.constraints) >= self.enough:
                self.answered.set()

    def close(self):
        self.stopping.set()
        self.thread.join()
        self.sock.close(0)
        self.ctx.term()


def test_the_load_keeps_k_compiles_in_flight_counts_answers_and_drains_on_stop():
    compiler = BatchingCompilerForTest(batch=3, enough=12)
    try:
        load = CompileLoad([compiler.address], "tok", properties=3, in_flight=3, reply_timeout_s=5.0)
        load.start()
        assert compiler.answered.wait(10)
        compiler.flush.set()
        window = load.stop()
        first = list(compiler.constraints)
        again = load.start() or load.stop()                      # a second window starts afresh
    finally:
        compiler.close()
    assert compiler.batches[:4] == [3, 3, 3, 3]                   # K sent before any answer, refilled to K
    assert window.sent == len(first) == window.done + sum(window.errors.values())
    assert window.errors == {"GRAMMAR_TIMEOUT": len(first) // 3}
    assert window.compile_ms == [5.0] * window.done and window.cached == 0
    assert again.sent >= 3 and again.sent == again.done + sum(again.errors.values())
    assert len(set(compiler.constraints)) == len(compiler.constraints)   # every one salted apart, both windows


def test_the_load_needs_a_compiler_address():
    with pytest.raises(ValueError, match="no grammar compiler"):
        CompileLoad([], "tok", 3, 1, 5.0)


# ---- the command ----------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, says", [
    (["--compiler-cpus", "1"], "go together"),
    (["--compiler-cpus", "0", "--stack-cpus", "0"], "share CPUs 0"),
    (["--compiler-cpus", "0-x", "--stack-cpus", "1"], "bad CPU list"),
    (["--requests", "2", "--rounds", "3"], "--requests >= --rounds"),
    (["--rate", "0"], "must be > 0"),
])
def test_bad_arguments_are_refused_before_anything_starts(argv, says, tmp_path, capsys):
    assert run_bench([*argv, "--workdir", str(tmp_path / "work")]) == 2
    assert says in capsys.readouterr().err and not (tmp_path / "work").exists()


@pytest.mark.slow   # starts a unified stack (gateway, worker, grammar compiler) as processes
@pytest.mark.timeout(180)
def test_the_ttft_run_measures_both_sides_under_real_compiles_and_stops_the_stack(tiny_v41_model_dir, tmp_path,
                                                                                  capsys):
    out, work = tmp_path / "ttft.json", tmp_path / "work"
    usable = sorted(os.sched_getaffinity(0))
    pins = ["--compiler-cpus", str(usable[-1]), "--stack-cpus", str(usable[0])] if len(usable) > 1 else []
    # 200 properties: a light compile (~20 ms), enough to check the mechanics
    argv = ["--quick", "--topology", "unified", "--compile-processes", "1", "--grammar-properties", "200",
            "--rate", "4", "--model-dir", str(tiny_v41_model_dir), "--workdir", str(work), "--json", str(out), *pins]
    assert run_bench(argv) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out

    doc = json.loads(out.read_text())
    result = doc["ttft_under_compile"]
    assert doc["bench"] == "grammar" and result["topology"] == "unified" and result["compile_processes"] == 1
    assert [(w["round"], w["side"]) for w in result["per_window"]] == [(0, "baseline"), (0, "loaded")]
    base, loaded = result["baseline"], result["loaded"]
    for side in (base, loaded):
        assert side["requests"] == 4 and 0 < side["ttft_ms_p50"] <= side["ttft_ms_p99"]
        assert side["cached_tokens"] == 0                      # the second copy of a request missed the cache
    assert loaded["compiles_done"] >= 1 and loaded["compile_errors"] == {} and loaded["compiles_cached"] == 0
    assert base["compiles_sent"] == 0
    rows = [r for w in result["per_window"] for r in w["requests_detail"]]
    assert sorted((r["side"], r["index"]) for r in rows) == sorted((s, i) for s in ("baseline", "loaded")
                                                                    for i in range(4))
    assert all(0 < r["ttft_ms"] <= r["total_ms"] and 1 <= r["completion_tokens"] <= 8 for r in rows)
    if pins:
        assert result["pinning"]["mode"] == "pinned" and result["pinning"]["misplaced_after"] == []
        assert result["pinning"]["processes"]["compiler"] >= 2     # the service and its compile process
        assert f"pinned: compiler on CPUs {usable[-1]}" in printed
    assert "TTFT of plain requests while heavy grammars compile" in printed and "p99 vs base" in printed

    state = json.loads((work / "runs" / "bench" / "state.json").read_text())
    assert state["status"] == "stopped" and not any(pid_alive(s["pid"]) for s in state["services"] if s["pid"])
