"""GPU pinning in topologies: `gpus = [...]` on a model-running service puts replica i on GPU
gpus[i] (CUDA_VISIBLE_DEVICES in the launcher's env for that process, device "cuda" in its
settings); bad lists are clear errors; the gpu2 topology splits prefill and decode over two GPUs;
`epd bench stack` pins workers and places the engine alone by its flags. CPU only: nothing here
touches a GPU (the launcher test records the env a child would get instead of starting it)."""
from __future__ import annotations

import argparse
import json
import tomllib

import pytest

import bench
from bench.stack.command import engine_device, pinned_gpus
from bench.common.local_stack import LocalStack, pinned_topology, topology_text
from ops.launcher import Supervisor
from ops.stack_commands import cmd_status
from ops.topology import load_topology, parse_topology

WORKER: dict = {}   # the model comes from the [model] table
MODEL = {"dir": "m", "dtype": "bfloat16"}


def topology(*services: dict) -> dict:
    return {"stack": {"port_base": 6100}, "model": MODEL,
            "service": [{"name": "prefill_router", "kind": "prefill_router"}, *services]}


def prefill(**fields) -> dict:
    return {"name": "prefill_worker", "kind": "prefill_worker", "upstream": "prefill_router",
            "settings": dict(WORKER), **fields}


# ---- parsing and validation -------------------------------------------------------------------
def test_each_replica_gets_its_own_gpu_and_the_device_setting_cuda():
    topo = parse_topology(topology(prefill(replicas=2, gpus=[3, 1])))
    spec = topo.spec("prefill_worker")
    assert spec.gpus == (3, 1) and [spec.gpu(0), spec.gpu(1)] == [3, 1]
    workers = [config for s, _, config in topo.instances() if s.name == "prefill_worker"]
    assert [c.instance for c in workers] == ["prefill_worker-0", "prefill_worker-1"]
    assert all(c.settings["device"] == "cuda" and c.settings["dtype"] == "bfloat16" for c in workers)
    assert topo.instance_env("prefill_worker-0") == {"CUDA_VISIBLE_DEVICES": "3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert topo.instance_env("prefill_worker-1")["CUDA_VISIBLE_DEVICES"] == "1"
    assert topo.instance_env("prefill_router-0") == {} and topo.gpu_of("prefill_router-0") is None
    assert topo.gpu_of("prefill_worker-2") is None and topo.gpu_of("nobody-0") is None


def test_fewer_replicas_than_gpus_take_the_first_and_an_explicit_cuda_device_is_kept():
    topo = parse_topology(topology(prefill(gpus=[2, 5], settings={**WORKER, "device": "cuda:0"})))
    assert topo.instance_env("prefill_worker-0")["CUDA_VISIBLE_DEVICES"] == "2"
    assert topo.spec("prefill_worker").options["settings"]["device"] == "cuda:0"


def test_services_may_share_a_gpu_and_services_without_gpus_stay_unpinned():
    vision = {"name": "vision_worker", "kind": "vision_worker", "gpus": [0], "settings": {}}
    decode = {"name": "decode_worker", "kind": "decode_worker", "settings": dict(WORKER)}
    topo = parse_topology(topology(prefill(gpus=[0]), vision, decode))
    assert topo.gpu_of("prefill_worker-0") == topo.gpu_of("vision_worker-0") == 0
    assert topo.gpu_of("decode_worker-0") is None
    assert "device" not in topo.spec("decode_worker").options["settings"]


@pytest.mark.parametrize("fields, message", [
    ({"replicas": 3, "gpus": [0, 1]}, r"replicas = 3 but gpus lists 2 \(\[0, 1\]\)"),
    ({"replicas": 2, "gpus": [1, 1]}, "names a GPU twice"),
    ({"gpus": [-1]}, "ints >= 0"),
    ({"gpus": ["0"]}, "ints >= 0"),
    ({"gpus": [True]}, "ints >= 0"),
    ({"gpus": [0.0]}, "ints >= 0"),
    ({"gpus": []}, "ints >= 0"),
    ({"gpus": 0}, "ints >= 0"),
    ({"gpus": [1], "settings": {**WORKER, "device": "cuda:1"}}, "sees only its own GPU, as cuda:0"),
    ({"gpus": [1], "settings": {**WORKER, "device": "cpu"}}, "sees only its own GPU"),
])
def test_bad_gpus_are_clear_errors_naming_the_service(fields, message):
    with pytest.raises(ValueError, match=message) as raised:
        parse_topology(topology(prefill(**fields)))
    assert "service prefill_worker" in str(raised.value)


def test_a_kind_that_runs_no_model_takes_no_gpus():
    with pytest.raises(ValueError, match="kind prefill_router runs no model on a device"):
        parse_topology({"service": [{"name": "prefill_router", "kind": "prefill_router", "gpus": [0]}]})


# ---- the embedded topologies --------------------------------------------------------------------
def test_gpu2_puts_prefill_and_decode_on_different_gpus_in_bfloat16():
    topo = load_topology("gpu2")
    gpus = {c.instance: topo.gpu_of(c.instance) for _, _, c in topo.instances() if topo.gpu_of(c.instance) is not None}
    assert gpus == {"prefill_worker-0": 0, "decode_worker-0": 1, "vision_worker-0": 0}
    for spec in topo.services:
        settings = spec.options.get("settings", {})
        if spec.gpus:
            assert settings["device"] == "cuda" and settings["dtype"] == "bfloat16", spec.name
        elif "dtype" in settings:   # the gateway's dtype names the model the workers serve
            assert settings["dtype"] == "bfloat16", spec.name
    assert {s.kind for s in topo.services} == {s.kind for s in load_topology("default").services}


def test_the_default_topology_pins_nothing():
    topo = load_topology("default")
    assert all(not spec.gpus and "device" not in spec.options.get("settings", {}) for spec in topo.services)
    assert all(topo.instance_env(c.instance) == {} for _, _, c in topo.instances())


# ---- the launcher's env per process -------------------------------------------------------------
class RecordedPopen:
    """Test helper: stands in for subprocess.Popen in the launcher and keeps the env each child got."""
    envs: dict[str, dict] = {}
    pid = 4242

    def __init__(self, argv, env, **_kwargs):
        RecordedPopen.envs[env["EPD_INSTANCE"]] = env

    def poll(self):
        return None


def test_the_launcher_starts_each_pinned_replica_with_its_gpu_alone(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("ops.launcher.subprocess.Popen", RecordedPopen)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")   # the launcher's own: replaced, not narrowed
    RecordedPopen.envs = {}
    decode = {"name": "decode_worker", "kind": "decode_worker", "replicas": 2, "gpus": [1, 0],
              "settings": dict(WORKER)}
    supervisor = Supervisor(parse_topology(topology(prefill(gpus=[2]), decode)), tmp_path)
    for child in supervisor.children:
        supervisor.spawn(child)
    envs = RecordedPopen.envs
    assert {name: env.get("CUDA_VISIBLE_DEVICES") for name, env in envs.items()} == {
        "prefill_router-0": "6,7", "prefill_worker-0": "2", "decode_worker-0": "1", "decode_worker-1": "0"}
    assert envs["decode_worker-1"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert json.loads(envs["decode_worker-1"]["EPD_SETTINGS"])["device"] == "cuda"
    logged = [json.loads(line) for line in (tmp_path / "logs" / "supervisor.log").read_text().splitlines()]
    assert {(e["instance"], e["gpu"]) for e in logged if e["event"] == "service.gpu"} == {
        ("prefill_worker-0", "2"), ("decode_worker-0", "1"), ("decode_worker-1", "0")}

    # state.json keeps each instance's GPU, and `epd status` shows it (nothing answers here: unreachable)
    supervisor.write_state()
    status = argparse.Namespace(run_dir=str(tmp_path), keys=None, timeout_s=0.05, json=False)
    assert cmd_status(status) == 3
    lines = capsys.readouterr().out.splitlines()
    header = lines[1].split()
    assert header[:4] == ["instance", "kind", "state", "gpu"]
    gpus = {line.split()[0]: line.split()[3] for line in lines[2:6]}
    assert gpus == {"prefill_router-0": "-", "prefill_worker-0": "2", "decode_worker-0": "1", "decode_worker-1": "0"}


# ---- epd bench stack ----------------------------------------------------------------------------
def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="epd")
    bench.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", "stack", *argv])


def test_bench_flags_pin_the_workers_and_place_the_engine_alone():
    args = bench_args("--prefill-gpu", "0", "--decode-gpu", "1", "--engine-gpu", "1")
    assert pinned_gpus(args) == {"prefill_worker": 0, "decode_worker": 1}
    assert engine_device({"device": "cuda"}, args.engine_gpu) == "cuda:1"
    assert engine_device({"device": "cuda"}, None) == "cuda" and engine_device({}, None) == "cpu"
    assert pinned_gpus(bench_args()) == {}


def test_a_negative_gpu_flag_is_refused_before_anything_starts(capsys):
    args = bench_args("--decode-gpu", "-1")
    assert args.func(args) == 2
    assert "--decode-gpu must be a GPU index >= 0" in capsys.readouterr().err


def test_pinning_the_default_topology_gives_each_worker_its_gpu_and_the_baseline_cuda(tmp_path):
    stack = LocalStack("default", tmp_path / "model", tmp_path / "work",
                       gpus={"prefill_worker": 0, "decode_worker": 1})
    assert stack.worker_gpus() == {"prefill_worker-0": 0, "decode_worker-0": 1}
    written = tomllib.loads(stack.topology_path.read_text())
    pins = {s["kind"]: s.get("gpus") for s in written["service"]}
    assert pins["prefill_worker"] == [0] and pins["decode_worker"] == [1] and pins["gateway"] is None
    assert stack.engine_settings()["device"] == "cuda"                   # both workers: cuda, one engine


def test_bench_pins_replace_a_topologys_gpus_and_unpinnable_topologies_are_errors(tmp_path):
    text = pinned_topology(topology_text("gpu2"), {"decode_worker": 0})
    services = {s["name"]: s for s in tomllib.loads(text)["service"]}
    assert services["decode_worker"]["gpus"] == [0] and services["prefill_worker"]["gpus"] == [0]
    with pytest.raises(ValueError, match="has no prefill_worker service"):
        pinned_topology(topology_text("unified"), {"prefill_worker": 0})
    two = topology_text("default").replace('name = "decode_worker"\n', 'name = "decode_worker"\nreplicas = 2\n')
    with pytest.raises(ValueError, match="runs 2 replicas"):
        pinned_topology(two, {"decode_worker": 1})


def test_the_summary_title_says_where_each_pinned_worker_and_the_engine_alone_ran():
    from bench.stack.command import _gpu_note
    results = {"gpus": {"prefill_worker-0": 0, "decode_worker-0": 1}, "gpu_names": ["NVIDIA H200"] * 2,
               "engine_settings": {"device": "cuda"}}
    assert _gpu_note(results) == ("; host GPUs: 2 x NVIDIA H200; prefill_worker-0 on GPU 0, decode_worker-0 on GPU 1, "
                                  "engine alone on cuda")
    assert _gpu_note({"gpus": {}, "engine_settings": {"device": "cpu"}}) == ""
