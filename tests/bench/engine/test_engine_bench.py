"""`epd bench engine --config tiny --device cpu --quick` runs end to end: random weights drawn in place,
our engine and transformers' DeepseekV4 on the same tensors, every cell measured, the floor beside
them, a well-formed table and JSON. No timing asserts."""
from __future__ import annotations

import argparse
import datetime
import json

import pytest

import bench
from bench.engine import command as engine
from tests.helpers.test_helper_plot import png_size

pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The tiny model's many small ops run faster and steadier on one thread of a small, shared machine."""
    import torch
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def run_bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="epd")
    bench.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "engine", *argv])
    return args.func(args)


@pytest.mark.timeout(240)
def test_engine_bench_tiny_cpu_quick_writes_ours_hf_and_floor(tmp_path, capsys):
    out, plot = tmp_path / "engine.json", tmp_path / "engine.png"
    assert run_bench(["--config", "tiny", "--device", "cpu", "--quick", "--json", str(out), "--plot", str(plot)]) == 0

    doc = json.loads(out.read_text())
    assert doc["bench"] == "engine" and doc["complete"] is True
    datetime.datetime.fromisoformat(doc["date"])
    assert doc["config"] == "tiny" and doc["device"] == "cpu" and doc["dtype"] == "bfloat16"
    assert doc["rates"]["copy_bytes_per_s"] > 0 and doc["rates"]["matmul_flops_per_s"] > 0
    assert doc["weights"]["total"] > doc["weights"]["dense"] > 0 and doc["weights"]["expert"] > 0

    # HF ran on our very tensors: nothing big copied, and it computes the same model
    assert doc["hf_weights"]["shared"] > 0 and doc["hf_weights"]["copied_bytes"] < 1 << 20
    assert doc["agreement"]["argmax_equal"] is True and doc["agreement"]["max_rel_err"] < 0.1

    cells = {(b, c) for b in engine.QUICK["batches"] for c in engine.QUICK["contexts"]}
    for impl in ("ours", "hf"):
        rows = {(r["batch"], r["context"]): r for r in doc["rows"] if r["impl"] == impl}
        assert set(rows) == cells, impl
        for row in rows.values():
            assert row["status"] == "ok", row
            assert row["prefill_tokens_per_s"] > 0 and row["step_ms"] > 0
            assert len(row["step_ms_all"]) == engine.QUICK["warmup"] + engine.QUICK["steps"]
    assert any("profile" in r for r in doc["rows"] if r["impl"] == "ours")
    # CUDA graphs are asked for, but on the CPU no decode step is captured: the eager batched path runs
    assert doc["ours_engine"]["cuda_graphs"] is True and doc["ours_engine"]["graphs_captured"] == 0

    floors = {(f["batch"], f["context"]): f for f in doc["floors"]}
    assert set(floors) == cells
    assert all(f["decode_floor_ms"] > 0 and f["prefill_floor_tokens_per_s"] > 0 for f in floors.values())
    # more sequences touch more experts and read more KV
    assert floors[2, 256]["decode_bytes"] > floors[1, 256]["decode_bytes"] > floors[1, 128]["decode_bytes"]

    summary = doc["summary"]
    assert {(s["measure"], s["batch"], s["context"]) for s in summary} == {
        (m, b, c) for m in ("decode", "prefill") for b, c in cells}
    for line in summary:
        assert line["ours"] > 0 and line["hf"] > 0 and line["floor"] > 0
        assert line["vs_hf"] > 0 and line["x_floor"] > 0
    assert png_size(plot)   # --plot: tokens/s against batch (what it draws: test_engine_plot.py)

    printed = capsys.readouterr().out
    last = printed[printed.rindex("epd bench engine:"):]   # the ratio table comes last
    header = next(line for line in last.splitlines() if line.startswith("measure"))
    assert all(col in header for col in ("ours", "HF", "floor", "vs HF", "x floor"))
    body = [line for line in last.splitlines() if line.startswith(("decode", "prefill"))]
    assert len(body) == 2 * len(cells) and all(line.rstrip().endswith("x") for line in body)


def test_engine_bench_is_registered_and_reports_a_missing_gpu(capsys, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run_bench(["--config", "tiny", "--device", "cuda", "--quick"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
