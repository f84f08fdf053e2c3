"""The local supervisor behind `epd up`: start every service of a topology as a child process,
wait until all are ready, restart crashed ones with back-off, and on Ctrl-C / SIGTERM / `epd down`
drain and stop them all, leaving no process behind.

The run directory holds one log file per instance (JSON lines) and state.json, which `epd status`
and `epd down` read. Children get PR_SET_PDEATHSIG so they die with the supervisor even if it is
killed outright.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from messages.control import ServiceState
from ops.control_client import query_status
from ops.topology import Topology
from services.runtime.config import ServiceConfig

RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
STABLE_AFTER_S = 60.0          # a child running this long resets its back-off
KILL_MARGIN_S = 5.0            # after the grace period, SIGKILL what is left


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG: SIGTERM us (we drain) when the supervisor dies


@dataclass
class Child:
    name: str
    config: ServiceConfig
    log_path: Path
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    next_start: float = 0.0
    failures_in_row: int = 0

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class Supervisor:
    topology: Topology
    run_dir: Path
    children: list[Child] = field(default_factory=list)
    status: str = "starting"
    _stopping: bool = False

    def __post_init__(self) -> None:
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        for spec, _, config in self.topology.instances():
            self.children.append(Child(spec.name, config, self.run_dir / "logs" / f"{config.instance}.log"))

    # ---- start -------------------------------------------------------------------------
    def check_ports(self) -> list[str]:
        """Addresses already taken by another process (a clear error beats a crash loop)."""
        taken = []
        for child in self.children:
            for address in (child.config.bind.removeprefix("tcp://"), child.config.metrics_bind):
                host, _, port = address.rpartition(":")
                with socket.socket() as probe:
                    try:
                        probe.bind((host, int(port)))
                    except OSError:
                        taken.append(address)
        return taken

    def spawn(self, child: Child) -> None:
        env = {**os.environ, **child.config.to_env(), "PYTHONUNBUFFERED": "1"}
        log = open(child.log_path, "ab")
        try:
            child.proc = subprocess.Popen([sys.executable, "-m", "services.runtime.main"], env=env,
                                          stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          preexec_fn=_die_with_parent)
        finally:
            log.close()
        child.started_at = time.monotonic()
        self.write_state()

    def wait_ready(self, timeout_s: float) -> list[str]:
        """Instances not RUNNING (or not registered upstream) by the deadline; [] when all are ready."""
        deadline = time.monotonic() + timeout_s
        pending = {c.config.instance: c for c in self.children}
        ctx = zmq.Context()
        try:
            while pending and time.monotonic() < deadline and not self._stopping:
                for instance, child in list(pending.items()):
                    if not child.running():
                        continue
                    status = query_status(child.config.advertise, 0.5, ctx)
                    if (status and status.state == ServiceState.RUNNING
                            and (not child.config.upstream or status.upstream_connected)):
                        del pending[instance]
                self.reap_and_restart()
                time.sleep(0.1)
        finally:
            ctx.term()
        return sorted(pending)

    # ---- supervise ---------------------------------------------------------------------
    def reap_and_restart(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if self._stopping:
                return
            if child.proc is None:            # waiting out its back-off
                if now >= child.next_start:
                    self.spawn(child)
                continue
            if child.running():
                continue
            code = child.proc.returncode
            child.failures_in_row = 0 if now - child.started_at >= STABLE_AFTER_S else child.failures_in_row + 1
            delay = RESTART_BACKOFF_S[min(child.failures_in_row - 1, len(RESTART_BACKOFF_S) - 1)] \
                if child.failures_in_row else RESTART_BACKOFF_S[0]
            child.proc, child.next_start = None, now + delay
            child.restarts += 1
            self.event("service.exited", instance=child.config.instance, code=code, restart_in_s=delay)
            self.write_state()

    def supervise(self) -> None:
        while not self._stopping:
            self.reap_and_restart()
            time.sleep(0.2)

    # ---- stop --------------------------------------------------------------------------
    def request_stop(self, *_args) -> None:
        """Signal handler: only flips state; the main loop does the work."""
        self._stopping = True

    def stop_all(self) -> None:
        self._stopping = True
        self.status = "stopping"
        self.write_state()
        for child in self.children:
            if child.running():
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.topology.grace_s + KILL_MARGIN_S
        while any(c.running() for c in self.children) and time.monotonic() < deadline:
            time.sleep(0.05)
        for child in self.children:
            if child.running():
                self.event("service.killed", instance=child.config.instance, after_s=self.topology.grace_s)
                child.proc.kill()
                child.proc.wait()
        self.status = "stopped"
        self.write_state()

    # ---- state -------------------------------------------------------------------------
    def write_state(self) -> None:
        state = {
            "supervisor_pid": os.getpid(), "status": self.status, "topology": self.topology.source,
            "grace_s": self.topology.grace_s,
            "services": [{"name": c.name, "instance": c.config.instance, "kind": c.config.kind,
                          "address": c.config.advertise, "metrics": c.config.metrics_bind, "pid": c.pid,
                          "restarts": c.restarts, "log": str(c.log_path)} for c in self.children],
        }
        tmp = self.run_dir / "state.json.tmp"
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.run_dir / "state.json")

    def event(self, name: str, **fields) -> None:
        line = json.dumps({"ts": round(time.time(), 6), "level": "info", "event": name,
                           "service": "supervisor", "instance": "supervisor", **fields})
        with open(self.run_dir / "logs" / "supervisor.log", "a") as f:
            f.write(line + "\n")

    # ---- the whole run -----------------------------------------------------------------
    def run(self, on_ready=None) -> int:
        signal.signal(signal.SIGINT, self.request_stop)
        signal.signal(signal.SIGTERM, self.request_stop)
        taken = self.check_ports()
        if taken:
            self.status = "failed"
            self.write_state()
            print(f"epd up: addresses already in use: {', '.join(taken)} (another stack running? "
                  f"`epd down`, or pass --port-base)", file=sys.stderr)
            return 1
        for child in self.children:
            self.spawn(child)
        not_ready = self.wait_ready(self.topology.ready_timeout_s)
        if self._stopping:
            self.stop_all()
            return 130
        if not_ready:
            self.status = "failed"
            logs = ", ".join(str(c.log_path) for c in self.children if c.config.instance in not_ready)
            print(f"epd up: not ready after {self.topology.ready_timeout_s:.0f}s: {', '.join(not_ready)} "
                  f"(see {logs})", file=sys.stderr)
            self.stop_all()
            self.status = "failed"
            self.write_state()
            return 1
        if on_ready:   # before "ready" reaches state.json: `epd up --detach` then prints this banner
            on_ready(self)
        self.status = "ready"
        self.write_state()
        self.event("stack.ready", services=len(self.children))
        self.supervise()
        self.stop_all()
        return 0
