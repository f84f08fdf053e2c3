"""`epd bench vision --ttft`: the topology edits that make each policy's stack, the replay of the
vision workers' logs, refused arguments, and (slow) a tiny whole run on one policy's stack. No
timing asserts (a shared 2-core box)."""
from __future__ import annotations

import argparse
import json
import os
import tomllib

import pytest

import bench
from bench.common.local_stack import topology_text
from bench.common.topology_edit import with_service_settings
from bench.vision.ttft import cpu_slices, policy_topology
from bench.vision.ttft_logs import count_events, read_worker_logs
from tests.helpers.test_helper_stack import pid_alive


def run_bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="epd")
    bench.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "vision", "--ttft", *argv])
    return args.func(args)


def services(text: str) -> dict[str, dict]:
    return {s["name"]: s for s in tomllib.loads(text)["service"]}


# ---- the topology ---------------------------------------------------------------------------------
def test_each_policy_stack_sets_its_balancer_workers_and_engines_and_nothing_else():
    text = topology_text("default")
    args = argparse.Namespace(seed=7, device="cpu", dtype="bfloat16", torch_threads=2, max_batch_patches=4096,
                              vision_workers=4)
    before, after = services(text), services(policy_topology(text, "round_robin", args))
    assert after["vision_balancer"]["settings"] == {**before["vision_balancer"]["settings"],
                                                    "policy": "round_robin", "seed": 7}
    worker = after["vision_worker"]
    assert worker["replicas"] == 4 and worker["settings"] == {**before["vision_worker"]["settings"], "device": "cpu",
                                                              "torch_threads": 2, "max_batch_patches": 4096}
    for name in ("prefill_worker", "decode_worker"):
        assert after[name]["settings"] == {**before[name]["settings"], "device": "cpu"}
    assert tomllib.loads(policy_topology(text, "round_robin", args))["model"]["dtype"] == "bfloat16"   # one for all
    untouched = set(before) - {"vision_balancer", "vision_worker", "prefill_worker", "decode_worker"}
    assert untouched and all(after[name] == before[name] for name in untouched)


def test_settings_are_added_or_replaced_and_a_missing_kind_is_an_error():
    text = '[[service]]\nname = "a"\nkind = "a"\n\n[[service]]\nname = "b"\nkind = "b"\n[service.settings]\nx = 1\n'
    edited = services(with_service_settings(with_service_settings(text, "a", {"s": "v"}, replicas=3), "b", {"x": 2}))
    assert edited["a"] == {"name": "a", "kind": "a", "replicas": 3, "settings": {"s": "v"}}
    assert edited["b"]["settings"] == {"x": 2} and "replicas" not in edited["b"]
    with pytest.raises(ValueError, match="no vision_worker"):
        with_service_settings(text, "vision_worker", {"x": 1})


def test_vision_workers_get_cpu_slices_of_their_own_when_there_are_enough():
    assert cpu_slices(frozenset(range(8, 16)), 4) == [{8, 9}, {10, 11}, {12, 13}, {14, 15}]
    assert cpu_slices(frozenset({1, 2, 3}), 2) == [{1}, {2}]
    assert cpu_slices(frozenset({1}), 4) == [{1}] * 4      # fewer CPUs than workers: they share them


# ---- the workers' logs ----------------------------------------------------------------------------
def line(event: str, ts: float, **fields) -> str:
    return json.dumps({"event": event, "ts": ts, **fields})


def test_the_replay_gives_each_request_its_queue_to_last_batch_time(tmp_path):
    # r1 (2 images) and r2 (1) queued; one batch takes r1's two, the next r2's
    (tmp_path / "w0.log").write_text("\n".join([
        "not json", line("vision.queued", 10.0, request_id="r1", images=2, patches=300),
        line("vision.queued", 10.5, request_id="r2", images=1, patches=50),
        line("vision.batch", 11.0, images=2, encode_ms=900.0), line("vision.batch", 11.25, images=1, encode_ms=40.0)]))
    # r1's third image went to another worker and took longer
    (tmp_path / "w1.log").write_text("\n".join([line("vision.queued", 10.1, request_id="r1", images=1, patches=20),
                                                line("vision.batch", 12.0, images=1, encode_ms=10.0)]))
    logs = read_worker_logs([tmp_path / "w0.log", tmp_path / "w1.log"])
    assert logs.vision_s(["r1", "r2", "r3"]) == pytest.approx({"r1": 2.0, "r2": 0.75})
    assert logs.patch_shares(["r1"]) == {"w0": 300, "w1": 20}
    assert logs.encode_ms_between(10.0, 11.5) == [900.0, 40.0] and logs.unmatched == []
    assert count_events([tmp_path / "w0.log"], "vision.batch") == 2


def test_a_worker_whose_batches_outrun_its_queue_is_left_out(tmp_path):
    (tmp_path / "w0.log").write_text("\n".join([line("vision.queued", 1.0, request_id="r1", images=1, patches=5),
                                                line("vision.batch", 2.0, images=2, encode_ms=1.0)]))
    logs = read_worker_logs([tmp_path / "w0.log"])
    assert logs.unmatched == ["w0"] and logs.vision_s(["r1"]) == {}


# ---- the command ----------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, says", [
    (["--vision-cpus", "1"], "go together"),
    (["--vision-cpus", "0", "--stack-cpus", "0"], "share CPUs 0"),
    (["--requests", "2", "--rounds", "3"], "--requests >= --rounds"),
    (["--vision-workers", "0"], "must be > 0"),
])
def test_bad_arguments_are_refused_before_anything_starts(argv, says, tmp_path, capsys):
    assert run_bench([*argv, "--workdir", str(tmp_path / "work")]) == 2
    assert says in capsys.readouterr().err and not (tmp_path / "work").exists()


@pytest.mark.slow   # starts a default stack (two vision workers) as processes
@pytest.mark.timeout(240)
def test_a_tiny_run_measures_ttft_and_vision_latency_and_stops_the_stack(tiny_v41_model_dir, tmp_path, capsys):
    out, work = tmp_path / "ttft.json", tmp_path / "work"
    usable = sorted(os.sched_getaffinity(0))
    pins = ["--vision-cpus", str(usable[-1]), "--stack-cpus", str(usable[0])] if len(usable) > 1 else []
    argv = ["--quick", "--policies", "patches", "--requests", "3", "--vision-workers", "2", "--rate", "4",
            "--model-dir", str(tiny_v41_model_dir), "--workdir", str(work), "--json", str(out), *pins]
    assert run_bench(argv) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out

    result = json.loads(out.read_text())["ttft"]
    assert result["policies"] == ["patches"] and result["vision_workers"] == 2
    patches = result["per_policy"]["patches"]
    assert patches["requests"] == 3 and 0 < patches["ttft_ms_p50"] <= patches["ttft_ms_p99"]
    assert patches["vision_requests"] == 3 and 0 < patches["vision_ms_p50"] <= patches["vision_ms_p99"]
    assert patches["vs_reference"]["ttft_ms_p99"] == 1.0 and patches["cached_tokens"] == 0
    assert sum(patches["patches_per_worker"].values()) > 0 and len(patches["patches_per_worker"]) == 2
    assert [(w["round"], w["policy"]) for w in result["per_window"]] == [(0, "patches")]
    if pins:
        assert result["pinning"]["mode"] == "pinned" and result["pinning"]["misplaced_after"] == []
        assert result["pinning"]["processes"]["vision_worker-0"] == 1 and result["pinning"]["processes"]["stack"] > 2
    assert "TTFT and vision latency per balancing policy" in printed
    for column in ("TTFT p50 ms", "TTFT p99 ms", "p99 / patches", "vision p99 ms", "busiest / mean patches"):
        assert column in printed

    state = json.loads((work / "patches" / "runs" / "bench" / "state.json").read_text())
    assert state["status"] == "stopped" and not any(pid_alive(s["pid"]) for s in state["services"] if s["pid"])
