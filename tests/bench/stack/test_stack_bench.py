"""`epd bench stack` runs end to end on a tiny variant: the default (E/P/D) stack started as real
processes and stopped again, the engine alone beside it, the same greedy outputs on both sides, a
well-formed JSON document and the summary table last. No timing asserts."""
from __future__ import annotations

import argparse
import datetime
import json
import tomllib
from pathlib import Path

import pytest

import bench
from bench.stack import command as stack
from bench.common.local_stack import moved_topology
from bench.stack.sides import Outcome, Round
from tests.helpers.test_helper_plot import png_size
from tests.helpers.test_helper_stack import pid_alive

pytestmark = pytest.mark.slow   # starts service processes

STREAMS, ROUNDS, MAX_TOKENS = 2, 1, 4


def run_bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="epd")
    bench.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "stack", *argv])
    return args.func(args)


@pytest.mark.timeout(240)
def test_tiny_stack_bench_runs_both_sides_with_equal_outputs_and_stops_the_stack(tmp_path, tiny_v41_model_dir, capsys):
    out, work = tmp_path / "stack.json", tmp_path / "work"
    argv = ["--streams", str(STREAMS), "--rounds", str(ROUNDS), "--max-tokens", str(MAX_TOKENS),
            "--min-prompt", "20", "--max-prompt", "160", "--model-dir", str(tiny_v41_model_dir),
            "--workdir", str(work), "--json", str(out), "--plot", str(tmp_path / "stack.png")]
    assert run_bench(argv) == 0, capsys.readouterr().err

    doc = json.loads(out.read_text())
    assert doc["bench"] == "stack" and doc["streams"] == STREAMS and doc["rounds"] == ROUNDS
    datetime.datetime.fromisoformat(doc["date"])
    assert doc["machine"]["cores"] >= 1 and len(doc["load_avg_1m"]) == 2
    assert doc["engine_settings"]["model_dir"].endswith(tiny_v41_model_dir.name)
    assert doc["requests"] == STREAMS * ROUNDS and doc["mismatches"] == []

    rows = doc["per_request"]
    assert sorted((r["side"], r["round"], r["stream"]) for r in rows) == sorted(
        (side, r, s) for side in ("engine", "stack") for r in range(ROUNDS) for s in range(STREAMS))
    for row in rows:
        assert 15 <= row["prompt_tokens"] <= 170, row                     # sized to 20..160, within a few tokens
        assert 1 <= row["completion_tokens"] <= MAX_TOKENS and row["cached_tokens"] == 0, row
        assert 0 < row["ttft_ms"] <= row["total_ms"], row
    assert [r["side"] for r in doc["per_round"]] == ["engine", "stack"]      # round 1: engine first
    for side in ("engine", "stack"):
        summary = doc[side]
        assert summary["tokens_per_s"] > 0 and 0 < summary["ttft_ms_p50"] <= summary["ttft_ms_p99"]
        assert summary["cpu_s"] > 0 and summary["cpu_ms_per_token"] > 0
        assert summary["completion_tokens"] == sum(r["completion_tokens"] for r in rows if r["side"] == side)
    assert doc["tokens_per_s_ratio"] > 0 and len(doc["tokens_per_s_round_ratios"]) == ROUNDS
    assert doc["verdict"] == ("ok" if doc["tokens_per_s_ratio_median_round"] >= 0.9 else "MISS")
    assert doc["added_ttft_ms_p50"] <= doc["added_ttft_ms_p99"]

    state = json.loads((work / "runs" / "bench" / "state.json").read_text())
    kinds = {s["kind"] for s in state["services"]}
    assert {"gateway", "prefill_worker", "decode_worker"} <= kinds          # the disaggregated form ran
    assert not any(pid_alive(p) for p in [state["supervisor_pid"], *(s["pid"] for s in state["services"])])

    printed = capsys.readouterr().out
    last = printed[printed.rindex("stack vs engine alone"):]                   # the summary table comes last
    lines = {line.split("  ")[0]: line for line in last.splitlines()}
    assert set(lines) >= {"TTFT p50 ms", "TTFT p99 ms", "tokens/s, all rounds", "tokens/s, median round",
                          "CPU ms / output token", "equal outputs"}
    assert ">= 0.9x" in lines["tokens/s, median round"]
    assert f"{STREAMS * ROUNDS}/{STREAMS * ROUNDS}" in lines["equal outputs"]
    assert png_size(tmp_path / "stack.png")   # --plot: what it draws is test_stack_plot.py's


def test_an_unknown_topology_or_a_missing_model_is_a_clear_error_before_anything_starts(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert run_bench(["--topology", "no-such-topology", "--model-dir", str(model), "--workdir", str(tmp_path)]) == 1
    assert "no topology file or embedded topology named 'no-such-topology'" in capsys.readouterr().err
    assert run_bench(["--model-dir", str(tmp_path / "missing")]) == 2
    assert "no model at" in capsys.readouterr().err
    assert run_bench(["--streams", "0"]) == 2
    assert run_bench(["--engine-threads", "-1"]) == 2
    assert "--engine-threads must be >= 0" in capsys.readouterr().err


def test_fixed_peer_addresses_move_with_the_port_base_and_named_peers_stay():
    text = """
[stack]
host = "127.0.0.1"
port_base = 5600
[[service]]
name = "kv_writer"
kind = "kv_writer"
[[service]]
name = "prefill_worker"
kind = "prefill_worker"
[service.settings]
kv_writer = "tcp://127.0.0.1:5600"
swa_registry = "@swa_registry"
elsewhere = "tcp://127.0.0.1:9000"
"""
    settings = tomllib.loads(moved_topology(text, 31000))["service"][1]["settings"]
    assert settings == {"kv_writer": "tcp://127.0.0.1:31000", "swa_registry": "@swa_registry",
                        "elsewhere": "tcp://127.0.0.1:9000"}


def outcome(round_: int, stream: int, ttft: float, tokens: int = 4, text: str = "abc") -> Outcome:
    return Outcome(round_, stream, 50, ttft, ttft + 1.0, tokens, 0, "length", text)


def test_outputs_that_differ_are_mismatches_and_the_summary_pairs_requests():
    engine = Round("engine", 0, 2.0, [outcome(0, 0, 0.1), outcome(0, 1, 0.2)], cpu_s=1.0)
    stack_ = Round("stack", 0, 2.5, [outcome(0, 0, 0.3), outcome(0, 1, 0.25, tokens=3, text="abd")], cpu_s=1.4)
    mismatches = stack.compare_outputs([engine, stack_])
    assert [(m["stream"], m["field"]) for m in mismatches] == [(1, "completion_tokens"), (1, "text")]
    assert mismatches[1]["first_difference_at"] == 2

    summary = stack.summarize([engine, stack_])
    assert summary["engine"]["tokens_per_s"] == 4.0 and summary["stack"]["tokens_per_s"] == 2.8
    assert summary["tokens_per_s_ratio"] == 0.7 and summary["tokens_per_s_round_ratios"] == [0.7]
    assert summary["tokens_per_s_ratio_median_round"] == 0.7 and summary["verdict"] == "MISS"
    assert summary["engine"]["cpu_ms_per_token"] == 125.0 and summary["stack"]["cpu_ms_per_token"] == 200.0
    assert summary["cpu_per_token_ratio"] == 1.4
    assert (summary["added_ttft_ms_p50"], summary["added_ttft_ms_p99"]) == (200.0, 200.0)   # 50 ms and 200 ms


def test_the_baseline_engine_takes_the_workers_settings_but_not_their_thread_split(tmp_path, tiny_v41_model_dir):
    from bench.common.local_stack import LocalStack
    default = LocalStack("default", tiny_v41_model_dir, tmp_path / "default").engine_settings()
    assert "torch_threads" not in default and default["dtype"] == "float32"
    assert default["model_dir"].startswith(str((tmp_path / "default").resolve()))
    text = (Path(__file__).parents[3] / "ops/topologies/default.toml").read_text()
    differs = tmp_path / "differs.toml"
    differs.write_text(text.replace('num_pages = 512\n', 'num_pages = 256\n', 1))   # the model is one [model] table
    with pytest.raises(ValueError, match="run different engines"):
        LocalStack(str(differs), tiny_v41_model_dir, tmp_path / "differs").engine_settings()
