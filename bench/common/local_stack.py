"""A private local stack for `epd bench stack`: real processes started by `epd up --detach`.

Everything lives in one working directory of its own: the model linked where the topology's
relative `model_dir` points, the KV store the topology names (fresh, so no earlier run's blocks
hit), the run root (EPD_RUN_ROOT) with logs and state, and a copy of the topology with free ports.
`with LocalStack(...) as stack:` always ends with `epd down`, on errors and Ctrl-C too.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from importlib import resources
from pathlib import Path

from ops.gateway_ready import gateway_not_ready
from ops.ports import free_port_base

REPO = Path(__file__).resolve().parents[2]
WORKER_KINDS = ("decode_worker", "unified_worker", "prefill_worker")   # whose engine settings the baseline takes
UP_TIMEOUT_S = 300.0
HEALTH_TIMEOUT_S = 30.0
DOWN_TIMEOUT_S = 120.0
STATE_WAIT_S = 10.0             # an interrupted `epd up`: how long a supervisor may take to write its state


def default_topology() -> str:
    """"default" once it is the disaggregated form; until then the embedded "epd" topology."""
    text = (resources.files("ops.topologies") / "default.toml").read_text()
    kinds = {s.get("kind") for s in tomllib.loads(text).get("service", [])}
    return "default" if "prefill_worker" in kinds else "epd"


def topology_text(name_or_path: str) -> str:
    """The text of a topology file, or of an embedded topology by name (or by its older name)."""
    from ops import topology
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        return path.read_text()
    name_or_path = getattr(topology, "ALIASES", {}).get(name_or_path, name_or_path)
    embedded = resources.files("ops.topologies") / f"{name_or_path}.toml"
    if not embedded.is_file():
        raise ValueError(f"no topology file or embedded topology named {name_or_path!r}")
    return embedded.read_text()


def pinned_topology(text: str, gpus_by_kind: dict[str, int]) -> str:
    """The topology with every service of each kind pinned to that GPU (`gpus = [N]`, added or
    replaced; ops/topology.py gives it device "cuda"); ValueError when a kind has no service or runs
    more than one replica (one GPU each: write a topology file for that)."""
    blocks = re.split(r"(?m)^(?=\[\[service\]\])", text)
    for kind, gpu in gpus_by_kind.items():
        found = False
        for n, block in enumerate(blocks):
            if not re.search(rf'(?m)^kind\s*=\s*"{re.escape(kind)}"', block):
                continue
            found, line = True, f"gpus = [{int(gpu)}]"
            if re.search(r"(?m)^gpus\s*=", block):
                blocks[n] = re.sub(r"(?m)^gpus\s*=.*$", line, block, count=1)
            else:   # a top-level key of the service: right after its [[service]] header
                blocks[n] = re.sub(r"(?m)^(\[\[service\]\][^\n]*\n)", rf"\g<1>{line}\n", block, count=1)
        if not found:
            raise ValueError(f"the topology has no {kind} service to pin to GPU {gpu}")
    edited = "".join(blocks)
    for service in tomllib.loads(edited).get("service", []):
        kind = service.get("kind")
        if kind in gpus_by_kind and service.get("replicas", 1) != 1:
            raise ValueError(f"{service.get('name')} runs {service['replicas']} replicas: pinning puts one "
                             "service on one GPU; list the replicas' GPUs in a topology file (`gpus`)")
        if kind in gpus_by_kind and service.get("gpus") != [gpus_by_kind[kind]]:
            raise ValueError(f"could not pin {kind} to GPU {gpus_by_kind[kind]} in the topology")
    return edited


def moved_topology(text: str, port_base: int) -> str:
    """The topology with fixed peer addresses in its settings (tcp://host:port of one of its own
    slots) moved with the port base; a topology that names its peers has none and stays as it is."""
    data = tomllib.loads(text)
    stack = data.get("stack", {})
    host, old_base = stack.get("host", "127.0.0.1"), stack.get("port_base", 5600)
    slots = sum(s.get("replicas", 1) for s in data.get("service", []))

    def move(match: re.Match) -> str:
        port = int(match.group(1))
        if not old_base <= port < old_base + slots:
            return match.group(0)
        return f"tcp://{host}:{port_base + port - old_base}"

    return re.sub(rf"tcp://{re.escape(host)}:(\d+)", move, text)


class LocalStack:
    """`epd up --detach` of a topology in `workdir`; `epd down` on exit, whatever happened."""

    def __init__(self, topology: str, model_dir: Path, workdir: Path, gpus: dict[str, int] | None = None) -> None:
        """`gpus`: service kind -> the GPU its one replica is pinned to (pinned_topology)."""
        from ops.topology import parse_topology
        self.workdir = workdir.resolve()
        self.model_dir = model_dir.resolve()
        text = topology_text(topology)
        if gpus:
            text = pinned_topology(text, gpus)
        count = len(parse_topology(tomllib.loads(text)).instances())
        offset = tomllib.loads(text).get("stack", {}).get("metrics_offset", 100)
        self.port_base = free_port_base(count + 1, offset)    # the HTTP API takes the slot after the services
        self.http_port = self.port_base + count
        self.topology_path = self.workdir / "topology.toml"
        self.run_dir = self.workdir / "runs" / "bench"
        self.env = {**os.environ, "EPD_RUN_ROOT": str(self.workdir / "runs"),
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.topology_path.write_text(moved_topology(text, self.port_base))
        self.topology = parse_topology(tomllib.loads(self.topology_path.read_text()),
                                       source=str(self.topology_path), port_base=self.port_base)
        self.url = f"http://127.0.0.1:{self.http_port}"
        self._link_model()

    # ---- what the baseline needs from the topology -------------------------------------------
    def engine_settings(self) -> dict:
        """EngineConfig fields of the workers (model_dir made absolute); they must agree."""
        from engine.engine_core import EngineConfig
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        workers = sorted((s for s in self.topology.services if s.kind in WORKER_KINDS),
                         key=lambda s: WORKER_KINDS.index(s.kind))
        if not workers:
            raise ValueError(f"topology {self.topology.source} has no worker ({', '.join(WORKER_KINDS)})")
        # torch_threads splits the cores between the stack's engine processes, so it may differ per
        # worker; the engine alone is one process and gets --engine-threads (default: every core)
        fields.discard("torch_threads")
        settings = [{k: v for k, v in s.options.get("settings", {}).items() if k in fields} for s in workers]
        for spec, other in zip(workers[1:], settings[1:]):
            if other != settings[0]:
                raise ValueError(f"workers {workers[0].name} and {spec.name} run different engines "
                                 f"({settings[0]} vs {other}): no single baseline to compare with")
        return {**settings[0], "model_dir": str(self.workdir / settings[0]["model_dir"])}

    def worker_gpus(self) -> dict[str, list[int]]:
        """Instance -> the GPU it is pinned to, for every pinned instance of the topology."""
        return {config.instance: spec.gpu(replica) for spec, replica, config in self.topology.instances()
                if spec.gpu(replica) is not None}

    def gateway_settings(self) -> dict:
        gateways = [s for s in self.topology.services if s.kind == "gateway"]
        if not gateways:
            raise ValueError(f"topology {self.topology.source} has no gateway")
        return dict(gateways[0].options.get("settings", {}))

    def service_pids(self) -> list[int]:
        """The running stack's service processes (from the supervisor's state)."""
        state = json.loads((self.run_dir / "state.json").read_text())
        return [s["pid"] for s in state["services"] if s["pid"]]

    # ---- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> "LocalStack":
        try:
            self._up()
            self._wait_healthy()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def _up(self) -> None:
        up = self._epd("up", "--detach", "--topology", str(self.topology_path), "--port-base", str(self.port_base),
                       "--http-port", str(self.http_port), "--run-dir", str(self.run_dir),
                       "--wait-s", str(UP_TIMEOUT_S), timeout_s=UP_TIMEOUT_S + 30)
        if up.returncode != 0:
            raise RuntimeError(f"epd up failed ({up.returncode}); logs in {self.run_dir}\n{up.stdout}{up.stderr}")

    def _wait_healthy(self) -> None:
        """The gateway's /ready is 200: every pool behind it has a live registered worker (its /health
        answers 200 as soon as it runs, workers still loading)."""
        deadline, missing = time.monotonic() + HEALTH_TIMEOUT_S, {}
        while time.monotonic() < deadline:
            missing = gateway_not_ready(self.url)
            if not missing:
                return
            time.sleep(0.1)
        why = "; ".join(f"{pool}: {reason}" for pool, reason in sorted(missing.items()))
        raise RuntimeError(f"the gateway at {self.url} is not ready after {HEALTH_TIMEOUT_S:.0f}s ({why})")

    def down(self) -> None:
        """Stop the stack if one was started; a second Ctrl-C does not interrupt the stop."""
        state = self.run_dir / "state.json"
        if not (self.run_dir / "supervisor.out").exists():
            return                                   # `epd up` never got to start a supervisor
        deadline = time.monotonic() + STATE_WAIT_S
        while not state.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not state.exists():
            print(f"epd bench stack: no stack state in {self.run_dir}; nothing to stop", file=sys.stderr)
            return
        if json.loads(state.read_text()).get("status") == "stopped":
            return
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            down = self._epd("down", "--run-dir", str(self.run_dir), timeout_s=DOWN_TIMEOUT_S)
        finally:
            signal.signal(signal.SIGINT, previous)
        if down.returncode != 0:
            print(f"epd bench stack: epd down failed: {down.stdout}{down.stderr}", file=sys.stderr)

    def _epd(self, *argv: str, timeout_s: float) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ops.cli", *argv], cwd=self.workdir, env=self.env,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s)

    def _link_model(self) -> None:
        """Every relative model_dir of the topology points at the model directory."""
        for spec in self.topology.services:
            relative = spec.options.get("settings", {}).get("model_dir")
            if not relative or Path(relative).is_absolute():
                continue
            link = self.workdir / relative
            if link.is_symlink() or link.exists():
                continue
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(self.model_dir, target_is_directory=True)
