"""`epd bench gateway --quick` runs end to end: every cell measured, prompts of the asked size, the
same text from ours and bare, a well-formed JSON document and tables with the verdicts last.
No timing asserts."""
from __future__ import annotations

import argparse
import datetime
import json

import pytest

import bench
from bench.gateway import command as gateway

PATHS = ("ours", "bare")
PROTOCOLS = ("chat", "responses", "messages")


def run_bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="epd")
    bench.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "gateway", *argv])
    return args.func(args)


@pytest.mark.timeout(300)
def test_quick_gateway_bench_measures_every_cell_and_writes_table_and_json(tmp_path, capsys):
    out = tmp_path / "gateway.json"
    assert run_bench(["--quick", "--seconds", "0.05", "--json", str(out)]) == 0

    doc = json.loads(out.read_text())
    assert doc["bench"] == "gateway" and doc["quick"] is True and doc["seconds_per_measurement"] == 0.05
    date = datetime.datetime.fromisoformat(doc["date"])
    assert doc["machine"]["cpu_model"] and doc["machine"]["cores"] >= 1 and doc["tokenize_threads"] >= 1
    assert len(doc["load_avg_1m"]) == 2

    assert {(r["prompt"], r["path"]) for r in doc["prepare"]} == {(s, p) for s in gateway.QUICK_SIZES for p in PATHS}
    for row in doc["prepare"]:
        assert abs(row["prompt_tokens"] - row["target_tokens"]) <= gateway.TOKEN_TOLERANCE * row["target_tokens"]
        assert row["calls"] > 0 and row["wall_ms_p50"] > 0 and row["cpu_ms_p50"] >= 0 and row["req_per_s"] > 0, row

    assert {(r["protocol"], r["path"]) for r in doc["stream"]} == {(p, q) for p in PROTOCOLS for q in PATHS}
    for row in doc["stream"]:
        assert row["tokens"] == doc["answer_tokens"] == gateway.QUICK_ANSWER_TOKENS
        assert row["streams"] > 0 and row["frames"] > 0 and row["wall_us_per_token"] > 0, row

    assert [(r["mode"], r["path"]) for r in doc["loop_lag"]] == list(gateway.LAG_MODES)
    for row in doc["loop_lag"]:
        assert row["prompt"] == "4k" and row["wakeups"] > 0, row
        assert 0 <= row["p50_ms"] <= row["p99_ms"] <= row["max_ms"], row
        assert (row["prompts"] > 0) == (row["mode"] != "idle"), row

    checks = [v["check"] for v in doc["verdicts"]]
    assert checks == [*(f"prepare {s}" for s in gateway.QUICK_SIZES), *(f"stream {p}" for p in PROTOCOLS),
                      "loop lag p99, 4k prompts in the executor"]
    assert all(v["ok"] in (True, False) for v in doc["verdicts"] if not v["check"].startswith("stream"))

    printed = capsys.readouterr().out
    last = printed[printed.rindex("\nours / bare: "):]          # the verdict table comes last
    title, header, rule, *rows = last.strip().splitlines()
    assert date.isoformat() in title and doc["machine"]["cpu_model"] in title
    assert header.split() == ["check", "CPU", "x", "wall", "x", "p99", "ms", "target", "verdict"]
    assert len(header) == len(rule) and [r.split("  ")[0] for r in rows] == checks
    for section in ("prepare = convert + render + encode", "stream: one token id per push", "event loop lag"):
        assert printed.index(section) < printed.index("\nours / bare: ")


def test_verdicts_judge_prepare_on_cpu_and_flag_a_late_loop():
    def prepare(name, path, cpu, wall):
        return {"prompt": name, "path": path, "cpu_ms_p50": cpu, "wall_ms_p50": wall}

    def stream(path, us):
        return {"protocol": "chat", "path": path, "cpu_us_per_token": us, "wall_us_per_token": us}

    lag = [{"mode": "executor", "path": "ours", "prompt": "64k", "p99_ms": 12.0},
           {"mode": "executor", "path": "bare", "prompt": "64k", "p99_ms": 1.0}]
    costly, slow_wall, streamed, lagged = gateway.compare(
        [prepare("1k", "ours", 1.3, 1.1), prepare("1k", "bare", 1.0, 1.0),
         prepare("8k", "ours", 1.1, 1.5), prepare("8k", "bare", 1.0, 1.0)],
        [stream("ours", 8.0), stream("bare", 2.0)], lag)
    assert (costly["cpu_ratio"], costly["wall_ratio"], costly["ok"]) == (1.3, 1.1, False)
    assert (slow_wall["wall_ratio"], slow_wall["ok"]) == (1.5, True)    # wall is shown, not judged
    assert (streamed["cpu_ratio"], streamed["ok"]) == (4.0, None)
    assert (lagged["check"], lagged["p99_ms"], lagged["ok"]) == ("loop lag p99, 64k prompts in the executor", 12.0, False)


def test_visible_text_reads_each_protocols_deltas():
    frames = [b'data: {"choices":[{"delta":{"reasoning_content":"hm","content":null}}]}\n\n',
              b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n', b"data: [DONE]\n\n",
              b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":" there"}\n\n',
              b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"type":"thinking_delta",'
              b'"thinking":"!"}}\n\n']
    assert gateway.visible_text(frames) == ("hm!", "Hi there")
