"""`epd bench kv --quick` runs end to end with tiny sizes: both sides measured, lookups timed, the
summary table printed last with ratios and targets, JSON written, no files left. No timing asserts."""
from __future__ import annotations

import argparse
import datetime
import json
import os

import bench
from bench.kv import command as kv


def run_bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="epd")
    bench.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "kv", *argv])
    return args.func(args)


def test_kv_bench_quick_measures_both_sides_and_lookups_and_writes_table_and_json(tmp_path, capsys):
    out, work = tmp_path / "kv.json", tmp_path / "work"
    work.mkdir()
    argv = ["--quick", "--json", str(out), "--dir", str(work), "--page-kib", "256", "--total-mib", "4",
            "--batch", "4", "--blocks", "2048", "--lookups", "20"]
    assert run_bench(argv) == 0

    doc = json.loads(out.read_text())
    assert doc["bench"] == "kv" and doc["rounds"] == 1 and doc["page_bytes"] == 256 << 10
    datetime.datetime.fromisoformat(doc["date"])
    assert doc["machine"]["cpu_model"] and doc["machine"]["cores"] >= 1
    for side in ("plain", "store"):
        assert all(v > 0 for v in doc["median"][side].values())
    assert doc["lookup"]["blocks"] == 2048 and doc["lookup"]["restart_s"] > 0
    assert [r["chain_blocks"] for r in doc["lookup"]["lookups"]] == list(kv.LOOKUP_LENGTHS)
    for r in doc["lookup"]["lookups"]:
        assert 0 < r["p50_us"] <= r["p99_us"] <= r["max_us"]
    measures = [m["measure"] for m in doc["summary"]]
    assert measures[:3] == ["write MB/s", "read MB/s, cold", "read MB/s, warm (page cache)"]
    assert all(m["verdict"] in ("ok", "MISS", "-") for m in doc["summary"])

    printed = capsys.readouterr().out
    summary = printed[printed.index("summary (median of"):]  # the summary table comes last
    assert "store/plain" in summary and ">= 0.8x" in summary and "p99 < 200 us" in summary
    assert len([line for line in summary.splitlines() if line.startswith(("write", "read", "lookup"))]) == 6
    assert os.listdir(work) == []                                # every bench file removed


def test_summary_compares_store_to_plain_and_flags_misses():
    median = {"plain": {"write_mbps": 1000.0, "read_cold_mbps": 1000.0, "read_warm_mbps": 4000.0},
              "store": {"write_mbps": 850.0, "read_cold_mbps": 700.0, "read_warm_mbps": 1000.0}}
    lookup = {"blocks": 1_000_000, "lookups": [{"chain_blocks": 64, "p50_us": 40.0, "p99_us": 90.0},
                                               {"chain_blocks": 1024, "p50_us": 150.0, "p99_us": 250.0}]}
    write, cold, warm, short, long = kv.summarize(median, lookup)
    assert (write["ratio"], write["verdict"]) == (0.85, "ok")
    assert (cold["ratio"], cold["verdict"]) == (0.7, "MISS")
    assert warm["verdict"] == "-" and warm["target"] is None
    assert short["verdict"] == "ok" and long["verdict"] == "MISS"
