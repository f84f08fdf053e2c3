"""The stack `epd chaos` works on: started here (the default topology with 2 prefill and 2 decode
workers, in a working directory of its own) or attached to (`--run-dir`, `--url`).

Everything here reads the supervisor's state.json (pids, addresses, restarts) and asks services
for their status over their control socket, as `epd status` does. Every wait has a deadline and
returns what it saw, so a scenario reports a stack that did not recover instead of hanging.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from importlib import resources
from pathlib import Path

from ops.gateway_ready import gateway_not_ready
from ops.ports import free_port_base

REPO = Path(__file__).resolve().parents[2]
SCALED = ("prefill_worker", "decode_worker")     # the pools the chaos stack runs two of
UP_TIMEOUT_S = 240.0
DOWN_TIMEOUT_S = 60.0
POLL_S = 0.1


def scaled_topology_text(text: str, replicas: int, worker_settings: dict | None = None) -> str:
    """The topology with `replicas = N` for each service in SCALED (its `name = ...` line gets one),
    and `worker_settings` added to their settings tables."""
    extra = "".join(f"\n{key} = {json.dumps(value)}" for key, value in (worker_settings or {}).items())
    for name in SCALED:
        pattern = re.compile(rf'^(name\s*=\s*"{name}"\s*)$', re.MULTILINE)
        text, count = pattern.subn(rf"\1\nreplicas = {replicas}", text)
        if count != 1:
            raise ValueError(f"the topology has no single service named {name!r}")
        if extra:   # the first settings table after the service's name is its own
            at = text.index("[service.settings]", pattern.search(text).end()) + len("[service.settings]")
            text = text[:at] + extra + text[at:]
    data = tomllib.loads(text)    # fails loudly if the edit broke the file
    got = {s["name"]: s.get("replicas", 1) for s in data["service"]}
    assert all(got[name] == replicas for name in SCALED), got
    assert all(s["settings"][k] == v for s in data["service"] if s["name"] in SCALED
               for k, v in (worker_settings or {}).items()), "worker settings not applied"
    return text


class ChaosStack:
    """A running stack: its run directory (state.json, logs) and its HTTP API."""

    def __init__(self, run_dir: Path, url: str, workdir: Path | None = None, owned: bool = False) -> None:
        self.run_dir = run_dir.resolve()
        self.url = url.rstrip("/")
        self.workdir = workdir or self.run_dir.parent
        self.owned = owned                        # started here: stopped here
        self.env = epd_env(self.run_dir.parent)
        self.model = self._served_model()

    # ---- start / attach / stop ---------------------------------------------------------------
    @classmethod
    def start(cls, workdir: Path, model_dir: Path, replicas: int = 2,
              worker_settings: dict | None = None) -> "ChaosStack":
        """`epd up --detach` of the default topology scaled to `replicas` prefill and decode workers
        (with `worker_settings` added). The KV store path of the topology is relative, so it lands
        in `workdir`, fresh."""
        from ops.topology import parse_topology
        workdir = workdir.resolve()
        run_dir = workdir / "runs" / "chaos"
        run_dir.mkdir(parents=True, exist_ok=True)
        text = scaled_topology_text((resources.files("ops.topologies") / "default.toml").read_text(), replicas,
                                    worker_settings)
        topology_path = run_dir / "topology.toml"
        topology_path.write_text(text)
        count = len(parse_topology(tomllib.loads(text)).instances())
        base = free_port_base(count + 1)          # the HTTP API takes the slot after the services
        http_port = base + count
        argv = [sys.executable, "-m", "ops.cli", "up", "--detach", "--topology", str(topology_path),
                "--port-base", str(base), "--http-port", str(http_port), "--model", str(model_dir.resolve()),
                "--run-dir", str(run_dir), "--wait-s", str(UP_TIMEOUT_S)]
        env = epd_env(run_dir.parent)
        up = subprocess.run(argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                            timeout=UP_TIMEOUT_S + 30)
        if up.returncode != 0:
            if (run_dir / "state.json").exists():
                subprocess.run([sys.executable, "-m", "ops.cli", "down", "--run-dir", str(run_dir)], cwd=workdir,
                               env=env, capture_output=True, timeout=DOWN_TIMEOUT_S)
            raise RuntimeError(f"epd up failed ({up.returncode}); logs in {run_dir}\n{up.stdout}{up.stderr}")
        stack = cls(run_dir, f"http://127.0.0.1:{http_port}", workdir, owned=True)
        if not stack.wait_healthy(60.0):
            stack.down()
            raise RuntimeError(f"the stack in {run_dir} started but is not healthy")
        return stack

    @classmethod
    def attach(cls, run_dir: Path, url: str | None = None) -> "ChaosStack":
        """A stack someone else started; `url` defaults to where its gateway said it listens
        (its log's gateway.listening), else to the http_bind of its topology."""
        state = read_state(run_dir)
        if url is None:
            url = gateway_url(state) or f"http://{gateway_settings(state).get('http_bind', '127.0.0.1:8000')}"
        return cls(run_dir, url)

    def down(self) -> subprocess.CompletedProcess:
        """`epd down` of this run directory (drains: the supervisor's stop)."""
        return self.epd("down", "--run-dir", str(self.run_dir), timeout_s=DOWN_TIMEOUT_S)

    def epd(self, *argv: str, timeout_s: float) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ops.cli", *argv], cwd=self.workdir, env=self.env,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s)

    def _served_model(self) -> str:
        """The first model the gateway lists (/v1/models); `epd up --model` renames it."""
        try:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=5) as reply:
                return json.loads(reply.read())["data"][0]["id"]
        except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError):
            settings = gateway_settings(read_state(self.run_dir))
            return settings.get("served_model") or Path(settings.get("model_dir", "deepseek-v41-tiny")).name

    # ---- what runs ---------------------------------------------------------------------------
    def state(self) -> dict:
        return read_state(self.run_dir)

    def services(self, name: str | None = None) -> list[dict]:
        """state.json's service entries (instance, kind, pid, address, restarts, log), of one service name."""
        return [s for s in self.state()["services"] if name is None or s["name"] == name]

    def service(self, instance: str) -> dict:
        for svc in self.services():
            if svc["instance"] == instance:
                return svc
        raise KeyError(instance)

    def status(self, instance: str, timeout_s: float = 1.0):
        from ops.control_client import query_status
        return query_status(self.service(instance)["address"], timeout_s)

    def loads(self, name: str) -> dict:
        """instance -> its Load (None when it does not answer), for every replica of service `name`."""
        out = {}
        for svc in self.services(name):
            reply = self.status(svc["instance"])
            out[svc["instance"]] = reply.load if reply else None
        return out

    def signal(self, instance: str, sig: int) -> int:
        """Send `sig` to the instance's process; its pid."""
        pid = self.service(instance)["pid"]
        os.kill(pid, sig)
        return pid

    # ---- waits -------------------------------------------------------------------------------
    def wait_restarted(self, instance: str, old_pid: int, timeout_s: float) -> float | None:
        """Seconds until a new process of `instance` runs (and reached its upstream); None at the deadline."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            svc = self.service(instance)
            if svc["pid"] and svc["pid"] != old_pid and self._ready(svc):
                return time.monotonic() - start
            time.sleep(POLL_S)
        return None

    def wait_healthy(self, timeout_s: float) -> bool:
        """Every service running (workers registered upstream) and the gateway ready to serve: its /ready
        200, i.e. every pool behind it has a live registered worker (/health says only that it runs)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(self._ready(s) for s in self.services()) and self.http_ready():
                return True
            time.sleep(POLL_S)
        return False

    def not_ready(self) -> list[str]:
        """The instances not running, then each pool the gateway's /ready names, with why."""
        pools = [f"pool {pool}: {why}" for pool, why in sorted(self.gateway_not_ready().items())]
        return [s["instance"] for s in self.services() if not self._ready(s)] + pools

    def _ready(self, svc: dict) -> bool:
        from messages.control import ServiceState
        from ops.control_client import query_status
        reply = query_status(svc["address"], 0.5)
        return bool(reply and reply.state == ServiceState.RUNNING and reply.pid == svc["pid"]
                    and (not reply.upstream or reply.upstream_connected))

    def http_ready(self) -> bool:
        """The gateway's /ready is 200: every pool behind it has a live registered worker."""
        return not self.gateway_not_ready()

    def gateway_not_ready(self) -> dict[str, str]:
        """What the gateway's /ready says is not ready (pool -> why); {} when it answers 200."""
        return gateway_not_ready(self.url)

    # ---- processes and logs ------------------------------------------------------------------
    def rss_mib(self) -> dict[str, float]:
        """instance -> resident memory (VmRSS) in MiB, for each service process alive now."""
        out = {}
        for svc in self.services():
            rss = vm_rss_kib(svc["pid"])
            if rss is not None:
                out[svc["instance"]] = rss / 1024
        return out

    def log_lines(self, since_ts: float = 0.0) -> list[dict]:
        """Every JSON log line of every service (and the supervisor) stamped at or after since_ts."""
        lines = []
        for path in sorted((self.run_dir / "logs").glob("*.log")):
            with open(path, errors="replace") as f:
                for text in f:
                    try:
                        line = json.loads(text)
                    except ValueError:
                        continue
                    if isinstance(line, dict) and line.get("ts", 0) >= since_ts:
                        lines.append({**line, "_file": path.name})
        return lines


def epd_env(run_root: Path) -> dict[str, str]:
    """The environment of the `epd` commands run here: this checkout importable, runs under run_root."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
    return {**os.environ, "EPD_RUN_ROOT": str(run_root), "PYTHONPATH": path}


def read_state(run_dir: Path) -> dict:
    path = Path(run_dir) / "state.json"
    if not path.exists():
        raise FileNotFoundError(f"no stack state at {path}: is a stack running (`epd up`)?")
    return json.loads(path.read_text())


def gateway_settings(state: dict) -> dict:
    """The gateway's settings from the topology file the stack runs (empty when it has none)."""
    from ops.topology import load_topology
    source = state.get("topology", "default")
    topology = load_topology(source.removeprefix("embedded:"))
    gateways = [s for s in topology.services if s.kind == "gateway"]
    return dict(gateways[0].options.get("settings", {})) if gateways else {}


def gateway_url(state: dict) -> str | None:
    """The HTTP address the stack's first gateway last announced in its log (gateway.listening)."""
    url = None
    for svc in state["services"]:
        if svc["kind"] != "gateway":
            continue
        try:
            with open(svc["log"], errors="replace") as f:
                for text in f:
                    if '"gateway.listening"' in text:
                        url = json.loads(text).get("http", url)
        except (OSError, ValueError):
            continue
        return url
    return url


def vm_rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def send_cont(pid: int) -> None:
    """SIGCONT, whatever happened: a scenario that stopped a process always wakes it."""
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
