"""`epd bench vision --quick`: the simulation in full (every policy at every load, ratios against
the patch-aware policy), the real part on worker processes running the tiny V4.1 vision tower with
a tiny trace, tables printed, JSON written. The trace is seeded; the simulation reproducible. No
timing asserts on the real part (a shared 2-core box)."""
from __future__ import annotations

import argparse
import json

import pytest

from messages.images import VisionSizing
import bench
from bench.vision.sim import CostModel, arrival_scale, simulate
from bench.vision.trace import mixed_trace, spread


def run_bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="epd")
    bench.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "vision", *argv])
    return args.func(args)


def test_the_trace_is_seeded_and_its_patches_vary_widely():
    tiny = VisionSizing(patch_size=14, downsample_ratio=3, max_image_tokens=256, min_pixels=15876)
    assert mixed_trace(50, 2.0, tiny, seed=3) == mixed_trace(50, 2.0, tiny, seed=3)
    low, high = spread(mixed_trace(500, 2.0, tiny))
    assert high / low >= 10
    low, high = spread(mixed_trace(500, 2.0, VisionSizing()))   # the release: min_pixels is the floor
    assert high / low >= 5


def test_counting_patches_beats_the_baselines_in_the_simulation():
    trace = mixed_trace(3000, 1.0, VisionSizing(), seed=0)
    cost = CostModel()
    scale = arrival_scale(trace, 16, 0.8, cost)
    p99 = {}
    for policy in ("patches", "round_robin", "random"):
        latencies = sorted(simulate(trace, 2, 8, policy, cost, scale))
        p99[policy] = latencies[int(0.99 * len(latencies))]
    assert p99["patches"] < p99["round_robin"] < p99["random"]
    assert simulate(trace[:200], 2, 8, "random", cost, scale) == simulate(trace[:200], 2, 8, "random", cost, scale)


def test_sim_only_quick_run_prints_every_policy_at_every_load(tmp_path, capsys):
    out = tmp_path / "vision.json"
    assert run_bench(["--quick", "--skip-real", "--groups", "2", "--loads", "0.5,0.8", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [(r["load"], r["policy"]) for r in doc["simulation"]] == [
        (load, p) for load in (0.5, 0.8) for p in ("patches", "round_robin", "random")]
    assert all(r["n"] == 2000 and 0 < r["p50_ms"] <= r["p99_ms"] for r in doc["simulation"])
    printed = capsys.readouterr().out
    assert "simulation: 2 groups x 8 cards" in printed and "p99 / patches" in printed and "1.00x" in printed


@pytest.mark.slow   # starts a leader and two worker processes per policy
def test_quick_run_drives_real_worker_processes(tmp_path, capsys, tiny_v41_model_dir):
    out = tmp_path / "vision.json"
    argv = ["--quick", "--skip-sim", "--requests", "4", "--model-dir", str(tiny_v41_model_dir),
            "--workdir", str(tmp_path / "logs"), "--json", str(out)]
    assert run_bench(argv) == 0
    real = json.loads(out.read_text())["real"]
    assert [w["policy"] for w in real["windows"]] == ["patches", "round_robin", "random"]
    assert all(w["n"] == 4 and not w["errors"] and w["p50_ms"] > 0 for w in real["windows"])
    assert real["s_per_patch"] > 0
    printed = capsys.readouterr().out
    assert "real processes: 2 vision workers (cpu, float32)" in printed
