"""`epd bench wire` runs end to end with tiny durations: every cell measured, a well-formed table
and JSON, ratios flagged against the targets, and no echo server left behind. No timing asserts."""
from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import pytest

from ops import bench
from ops.bench import table, wire

CLIENTS = ("raw", "call", "lean")


def run_bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="epd")
    bench.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "wire", *argv])
    return args.func(args)


def bench_servers_of_this_process() -> list[str]:
    marker = f"ops.bench.wire\0serve\0{os.getpid()}\0"
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "cmdline").read_bytes().decode(errors="replace"):
                found.append(proc.name)
        except OSError:
            continue
    return found


@pytest.mark.timeout(240)
def test_wire_bench_measures_every_cell_and_writes_table_and_json(tmp_path, capsys):
    out = tmp_path / "wire.json"
    assert run_bench(["--seconds", "0.05", "--json", str(out)]) == 0

    doc = json.loads(out.read_text())
    assert doc["bench"] == "wire" and doc["baseline"] == wire.RAW_LABEL
    datetime.datetime.fromisoformat(doc["date"])
    assert doc["machine"]["cpu_model"] and doc["machine"]["cores"] >= 1
    cells = {(r["transport"], r["size"], r["client"]) for r in doc["results"]}
    assert cells == {(t, s.name, c) for t in wire.TRANSPORTS for s in wire.SIZES for c in CLIENTS}
    for row in doc["results"]:
        assert 0 < row["p50_us"] <= row["p99_us"], row
        assert row["msgs_per_s"] > 0 and row["replies"] > 0 and row["latency_samples"] > 0, row
    assert len(doc["ratios"]) == len(wire.TRANSPORTS) * len(wire.SIZES) * 2
    for ratio in doc["ratios"]:
        assert ratio["latency_ratio"] > 0 and ratio["overhead"] > 0
        assert ratio["target"] == {"64B": 1.5, "1MiB": 1.1}[ratio["size"]]

    printed = capsys.readouterr().out
    ratio_table = printed[printed.index("runtime / raw"):]   # the ratio table comes last
    assert "latency x" in ratio_table and "overhead x" in ratio_table and "verdict" in ratio_table
    assert len([line for line in ratio_table.splitlines() if line.startswith(("tcp", "ipc"))]) == 8
    assert wire.RAW_LABEL in printed
    assert bench_servers_of_this_process() == []


def test_wire_bench_runs_one_transport_when_asked(tmp_path):
    out = tmp_path / "ipc.json"
    assert run_bench(["--seconds", "0.02", "--transport", "ipc", "--json", str(out)]) == 0
    assert {r["transport"] for r in json.loads(out.read_text())["results"]} == {"ipc"}
    assert bench_servers_of_this_process() == []


def test_ratios_compare_runtime_to_raw_and_flag_misses():
    def row(client, size, p50, rate):
        return {"transport": "tcp", "size": size, "client": client, "p50_us": p50, "msgs_per_s": rate}

    ratios = wire.compare([row("raw", "64B", 100.0, 1000.0), row("lean", "64B", 140.0, 500.0),
                           row("raw", "1MiB", 400.0, 100.0), row("call", "1MiB", 420.0, 95.0)])
    small, large = ratios
    assert (small["latency_ratio"], small["overhead"]) == (1.4, 2.0)
    assert small["latency_ok"] and not small["throughput_ok"]
    assert large["latency_ok"] and large["throughput_ok"]


def test_table_aligns_columns_and_right_aligns_numbers():
    text = table.format_table(["name", "value"], [["a", 1.5], ["longer", 12345]], title="T")
    title, header, rule, first, second = text.splitlines()
    assert title == "T" and len(header) == len(rule)
    assert first.endswith("  1.50") and second.endswith("12,345")
    assert first.index("1.50") + 4 == second.index("12,345") + 6
