"""The local supervisor behind `epd up`: start every service of a topology as a child process,
wait until all are ready, restart crashed ones with back-off, and on Ctrl-C / SIGTERM / `epd down`
drain and stop them all, leaving no process behind.

A child that exits is reported at once: a line on stderr and in supervisor.log naming it, its exit
code and the reason (the last error its log holds), and in state.json, which `epd status` shows
("restarting", with the exit code) until it runs again.

A stop drains from the edge inwards, in waves (`stop_waves`): first the services nobody sends work
to (the gateway: it refuses new requests and finishes the ones it holds within the grace period),
and each next wave only once every service that feeds it has exited. So no service stops while
work for it is still on its way, and no stream loses its last chunks.

The run directory holds one log file per instance (JSON lines) and state.json, which `epd status`
and `epd down` read. Children run in process groups of their own (a Ctrl-C in the terminal reaches
the supervisor only, which stops them in order) and get PR_SET_PDEATHSIG, so they die with the
supervisor even if it is killed outright.

With `keys_dir` (`epd up --keys DIR`) every service runs with CURVE (ServiceConfig.keys_dir), the
supervisor's probes are CURVE clients, and state.json names each service's keys dir, where
`epd status` finds it.
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
from services.runtime.curve import load_keys

RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
STABLE_AFTER_S = 60.0          # a child running this long resets its back-off
KILL_MARGIN_S = 5.0            # a stop wave still running this long after the grace period is SIGKILLed
LOG_TAIL_BYTES = 8192          # how much of an exited child's log is searched for the reason


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG: SIGTERM us (we drain) when the supervisor dies


def port_in_use(address: str) -> bool:
    """Whether "host:port" (or tcp://host:port) is taken, probed as ZeroMQ and aiohttp bind: with
    SO_REUSEADDR, so connections of a stopped stack still in TIME_WAIT do not count."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host or "127.0.0.1", int(port)))
        except OSError:
            return True
    return False


def exit_reason(code: int, log_tail: str) -> str:
    """Why a child exited, in one line: the signal that killed it, else the last error in its log
    (the plain line `epd serve` writes on a failed start, a traceback's last line, an error event)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    for line in reversed(log_tail.splitlines()):
        line = line.strip()
        if not line.startswith("{"):
            if line:
                return line[:300]
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("level") in ("error", "critical"):
            return f"{record.get('event')}: {record.get('error', '')}"[:300]
    return "no error in its log"


def stop_waves(topology: Topology) -> list[list[str]]:
    """Service names in stop order, edge inwards: a service stops in a later wave than every service
    that sends it work. An HTTP front (a gateway: `http_bind` in its settings) sends work to its
    upstream; any other service is fed by its upstream (a router feeds the workers registered with
    it); and a service sends work to the peers its settings name ("@name")."""
    feeds: dict[str, set[str]] = {spec.name: set(spec.peers.values()) for spec in topology.services}
    fronts = {spec.name for spec in topology.services if spec.is_front}
    for spec in topology.services:
        if spec.upstream and spec.name in fronts:
            feeds[spec.name].add(spec.upstream)
        elif spec.upstream:
            feeds[spec.upstream].add(spec.name)
    # A service registered with a front (a grammar compiler, a vision group's leader) is named to the
    # workers in each request and called by them: it stops after every service on the request path.
    aides = {spec.name for spec in topology.services if spec.upstream in fronts}
    helped = _fed_by(feeds, aides)
    for spec in topology.services:
        if spec.name not in fronts and spec.name not in helped:
            feeds[spec.name] |= aides
    waves, left = [], [spec.name for spec in topology.services]
    while left:
        wave = [name for name in left if not any(name in feeds[other] for other in left if other != name)]
        wave = wave or left   # a cycle of services feeding each other: they stop together
        waves.append(wave)
        left = [name for name in left if name not in wave]
    return waves


def _fed_by(feeds: dict[str, set[str]], roots: set[str]) -> set[str]:
    """`roots` and every service they feed, directly or not."""
    seen, todo = set(roots), list(roots)
    while todo:
        for fed in feeds[todo.pop()]:
            if fed not in seen:
                seen.add(fed)
                todo.append(fed)
    return seen


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
    state: str = "new"          # its process: started, restarting (after an exit), stopped, killed
    exit_code: int | None = None   # of its last exit, and why (exit_reason)
    exit_reason: str = ""
    log_offset: int = 0         # where this process's lines begin in its log (it is appended to)

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self) -> str:
        """What this process wrote to its log, at most the last LOG_TAIL_BYTES."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(self.log_offset, f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
                return f.read().decode(errors="replace")
        except OSError:
            return ""


@dataclass
class Supervisor:
    topology: Topology
    run_dir: Path
    children: list[Child] = field(default_factory=list)
    status: str = "starting"
    keys_dir: str = ""          # CURVE keys for every service (and the probes); "" = as the topology says
    _stopping: bool = False

    def __post_init__(self) -> None:
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        for spec, _, config in self.topology.instances():
            if self.keys_dir:
                config.keys_dir = self.keys_dir
            self.children.append(Child(spec.name, config, self.run_dir / "logs" / f"{config.instance}.log"))
        # keys dir -> its keys, for the probes; a bad dir fails here (KeysError naming the file)
        # rather than as a crash loop of every service
        self._keys = {d: load_keys(d) for d in {c.config.keys_dir for c in self.children} if d}

    # ---- start -------------------------------------------------------------------------
    def check_ports(self) -> list[str]:
        """Addresses already taken by another process (a clear error beats a crash loop): every
        service's inbox and /metrics, and an HTTP front's API."""
        taken = []
        for child in self.children:
            config = child.config
            http = config.settings.get("http_bind", "")
            for address in (config.bind, config.metrics_bind, *([http] if isinstance(http, str) and http else [])):
                if address and port_in_use(address):
                    taken.append(address.removeprefix("tcp://"))
        return taken

    def spawn(self, child: Child) -> None:
        pinned = self.topology.instance_env(child.config.instance)   # a GPU-pinned replica sees its GPU alone
        env = {**os.environ, **child.config.to_env(), **pinned, "PYTHONUNBUFFERED": "1"}
        if pinned:   # which GPU each instance got, in supervisor.log
            self.event("service.gpu", instance=child.config.instance, gpu=pinned["CUDA_VISIBLE_DEVICES"])
        log = open(child.log_path, "ab")
        try:
            child.log_offset = log.seek(0, os.SEEK_END)
            child.proc = subprocess.Popen([sys.executable, "-m", "services.runtime.main"], env=env,
                                          stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          process_group=0, preexec_fn=_die_with_parent)
        finally:
            log.close()
        child.started_at = time.monotonic()
        child.state = "started"
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
                    status = query_status(child.config.advertise, 0.5, ctx, self._keys.get(child.config.keys_dir))
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
            # a service that ran stably and then died is restarted at once (its streams wait on it);
            # one that keeps failing backs off
            delay = RESTART_BACKOFF_S[min(child.failures_in_row - 1, len(RESTART_BACKOFF_S) - 1)] \
                if child.failures_in_row else 0.0
            child.proc, child.next_start = None, now + delay
            child.restarts += 1
            child.state, child.exit_code, child.exit_reason = "restarting", code, exit_reason(code, child.log_tail())
            self.report_exit(child, delay, round(now - child.started_at, 3))

    def report_exit(self, child: Child, restart_in_s: float, ran_s: float) -> None:
        """A child exited on its own: say so where the operator looks (stderr, supervisor.log, status)."""
        name = child.config.instance
        print(f"epd: {name} ({child.config.kind}) exited with code {child.exit_code} after {ran_s:.1f}s: "
              f"{child.exit_reason}; restarting in {restart_in_s:.0f}s (failure {child.failures_in_row} in a row; "
              f"log {child.log_path})", file=sys.stderr, flush=True)
        self.event("service.exited", level="error", instance=name, kind=child.config.kind, code=child.exit_code,
                   reason=child.exit_reason, ran_s=ran_s, restart_in_s=restart_in_s,
                   failures_in_row=child.failures_in_row, log=str(child.log_path))
        self.write_state()

    def supervise(self) -> None:
        while not self._stopping:
            self.reap_and_restart()
            time.sleep(0.2)

    # ---- stop --------------------------------------------------------------------------
    def request_stop(self, *_args) -> None:
        """Signal handler: only flips state; the main loop does the work."""
        self._stopping = True

    @property
    def stop_timeout_s(self) -> float:
        """The longest a stop takes: each wave drains within the grace period, or is killed after the margin."""
        return len(stop_waves(self.topology)) * (self.topology.grace_s + KILL_MARGIN_S)

    def stop_all(self) -> None:
        """Drain and stop every child, wave by wave from the edge inwards (stop_waves)."""
        self._stopping = True
        self.status = "stopping"
        self.write_state()
        waves = stop_waves(self.topology)
        print(f"epd: stopping, edge inwards: {' -> '.join(', '.join(w) for w in waves)} "
              f"(each drains within {self.topology.grace_s:g}s)", flush=True)
        for names in waves:
            wave = [c for c in self.children if c.name in names and c.running()]
            started = time.monotonic()
            self.event("stack.stopping", services=names, instances=[c.config.instance for c in wave])
            for child in wave:
                child.proc.send_signal(signal.SIGTERM)
            deadline = started + self.topology.grace_s + KILL_MARGIN_S
            while any(c.running() for c in wave) and time.monotonic() < deadline:
                time.sleep(0.05)
            for child in wave:
                if child.running():
                    self.event("service.killed", level="warning", instance=child.config.instance,
                               after_s=round(time.monotonic() - started, 3))
                    child.proc.kill()
                    child.proc.wait()
                    child.state = "killed"
                else:
                    child.state = "stopped"
                    self.event("service.stopped", instance=child.config.instance, code=child.proc.returncode)
            self.write_state()
        for child in self.children:   # one waiting out a back-off had nothing running to stop
            if child.state == "restarting":
                child.state = "stopped"
        killed = [c.config.instance for c in self.children if c.state == "killed"]
        print(f"epd: stack stopped{' (killed after the grace period: ' + ', '.join(killed) + ')' if killed else ''}",
              flush=True)
        self.status = "stopped"
        self.write_state()

    # ---- state -------------------------------------------------------------------------
    def write_state(self) -> None:
        state = {
            "supervisor_pid": os.getpid(), "status": self.status, "topology": self.topology.source,
            "grace_s": self.topology.grace_s, "stop_timeout_s": self.stop_timeout_s,
            "services": [{"name": c.name, "instance": c.config.instance, "kind": c.config.kind,
                          "address": c.config.advertise, "metrics": c.config.metrics_bind, "pid": c.pid,
                          "state": c.state, "restarts": c.restarts, "exit_code": c.exit_code,
                          "exit_reason": c.exit_reason, "log": str(c.log_path),
                          "keys_dir": c.config.keys_dir, "gpu": self.topology.gpu_of(c.config.instance)}
                         for c in self.children],
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
            late = [c for c in self.children if c.config.instance in not_ready]
            print(f"epd up: not ready after {self.topology.ready_timeout_s:.0f}s: {', '.join(not_ready)} "
                  f"(see {', '.join(str(c.log_path) for c in late)})", file=sys.stderr)
            for child in late:
                if child.exit_code is not None:
                    print(f"  {child.config.instance}: last exit code {child.exit_code}: {child.exit_reason}",
                          file=sys.stderr)
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
