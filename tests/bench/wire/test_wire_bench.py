"""`epd bench wire` runs end to end with tiny durations: every cell measured, a well-formed table
and JSON, ratios flagged against the targets, and no echo server left behind. No timing asserts."""
from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import pytest

import bench
from bench.common import table
from bench.wire import command as wire

CLIENTS = ("raw", "call", "lean")


def run_bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="epd")
    bench.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "wire", *argv])
    return args.func(args)


def bench_servers_of_this_process() -> list[str]:
    marker = f"bench.wire.servers\0{os.getpid()}\0"   # `python -m bench.wire.servers PARENT_PID ...`
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


@pytest.mark.timeout(240)
def test_wire_bench_curve_measures_every_cell_off_and_on_and_compares(tmp_path, capsys):
    out = tmp_path / "curve.json"
    # 1 MiB under CURVE takes ~20 ms a round trip here: long enough windows that every cell gets replies
    assert run_bench(["--seconds", "0.25", "--transport", "ipc", "--curve", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["curve_modes"] == ["off", "on"]
    cells = {(r["size"], r["client"], r["curve"]) for r in doc["results"]}
    assert cells == {(s.name, c, m) for s in wire.SIZES for c in CLIENTS for m in ("off", "on")}
    for row in doc["results"]:   # every CURVE cell got replies: keys, ZAP and all three clients work
        assert row["replies"] > 0 and row["latency_samples"] > 0, row
    assert {r["curve"] for r in doc["ratios"]} == {"off", "on"}   # runtime vs raw within one setting
    costs = doc["curve_costs"]
    assert {(c["size"], c["client"]) for c in costs} == {(s.name, c) for s in wire.SIZES for c in CLIENTS}
    for cost in costs:
        assert cost["latency_ratio"] == round(cost["p50_on_us"] / cost["p50_off_us"], 3)
        assert cost["throughput_ratio"] == round(cost["msgs_per_s_off"] / cost["msgs_per_s_on"], 3)
    printed = capsys.readouterr().out
    curve_table = printed[printed.index("CURVE on / off"):]
    assert "baseline = CURVE off" in curve_table
    assert len([line for line in curve_table.splitlines() if line.startswith("ipc")]) == len(costs)
    assert bench_servers_of_this_process() == []


def test_curve_costs_compare_each_cell_to_itself_with_curve_off():
    def row(client, curve, p50, rate):
        return {"transport": "tcp", "size": "64B", "client": client, "curve": curve, "p50_us": p50,
                "msgs_per_s": rate}

    rows = [row("raw", "off", 100.0, 1000.0), row("lean", "off", 200.0, 500.0),
            row("raw", "on", 150.0, 800.0), row("lean", "on", 250.0, 400.0)]
    raw_cost, lean_cost = wire.compare_curve(rows)
    assert (raw_cost["client"], raw_cost["latency_ratio"], raw_cost["throughput_ratio"]) == ("raw", 1.5, 1.25)
    assert (lean_cost["client"], lean_cost["latency_ratio"], lean_cost["throughput_ratio"]) == ("lean", 1.25, 1.25)
    ratios = wire.compare(rows)   # runtime vs raw never mixes CURVE settings
    assert [(r["curve"], r["latency_ratio"]) for r in ratios] == [("off", 2.0), ("on", round(250 / 150, 3))]


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
