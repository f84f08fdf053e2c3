"""The supervisor behind `epd up`: its port probe (TIME_WAIT leftovers are free), the stop order
(edge inwards, from the topology's graph), why a child exited, and, on real processes, a child that
cannot bind its port reported with its exit code and reason, backing off, and recovering."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ops.launcher import exit_reason, port_in_use, stop_waves
from ops.topology import load_topology, parse_topology
from tests.helpers.test_helper_processes import REPO, wait_until
from tests.helpers.test_helper_stack import free_port_base, pid_alive
from tests.ops.test_stack_commands import write_topology

RELAY = "tests.helpers.test_helper_relay:TestHelperRelay"


def test_a_port_in_time_wait_is_free_and_a_listening_one_is_taken():
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    assert port_in_use(f"tcp://127.0.0.1:{port}") and port_in_use(f"127.0.0.1:{port}")
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()   # the server side closes first, as a stopped service does: its end waits in TIME_WAIT
    client.close()
    server.close()
    with socket.socket() as plain, pytest.raises(OSError):   # what the old probe did: refused for ~60 s
        plain.bind(("127.0.0.1", port))
    assert not port_in_use(f"tcp://127.0.0.1:{port}")


def test_stop_waves_go_from_the_edge_inwards():
    # the services registered with the gateway (compiler, vision leader) are called by the workers
    # in each request: they stop after the request path, the vision workers after their leader
    assert stop_waves(load_topology("default")) == [
        ["gateway"], ["prefill_router"], ["prefill_worker", "decode_router"], ["decode_worker"],
        ["kv_writer", "swa_registry"], ["grammar_compiler", "vision_balancer"], ["vision_worker"]]
    assert stop_waves(load_topology("unified")) == [["gateway"], ["unified_worker"],
                                                    ["grammar_compiler", "vision_balancer"], ["vision_worker"]]
    looped = parse_topology({"service": [
        {"name": "a", "kind": "echo", "settings": {"peer": "@b"}},
        {"name": "b", "kind": "echo", "settings": {"peer": "@a"}},
        {"name": "hub", "kind": "echo", "settings": {"peer": "@a"}},
        {"name": "worker", "kind": "echo", "upstream": "hub"}]})
    assert stop_waves(looped) == [["hub"], ["worker"], ["a", "b"]]   # a cycle stops together, last


def test_exit_reason_is_the_signal_or_the_last_error_of_the_log():
    assert exit_reason(-9, "anything") == "killed by SIGKILL"
    bind_failed = ('{"event": "service.start_failed", "level": "error", "error": "cannot bind x"}\n'
                   '{"event": "service.stopped", "level": "info"}\n'
                   "epd serve: w-1 (echo) exits 1: cannot bind x\n")
    assert exit_reason(1, bind_failed) == "epd serve: w-1 (echo) exits 1: cannot bind x"
    assert exit_reason(1, bind_failed.rsplit("epd serve", 1)[0]) == "service.start_failed: cannot bind x"
    assert exit_reason(1, 'Traceback (most recent call last):\n  File "x"\nImportError: no torch\n') == \
        "ImportError: no torch"
    assert exit_reason(0, '{"event": "service.stopped", "level": "info"}\n') == "no error in its log"


class Stack:
    """`epd` in a scratch directory (its own run root), and what its run wrote."""

    def __init__(self, cwd: Path):
        self.cwd = cwd
        self.env = {**os.environ, "EPD_RUN_ROOT": str(cwd / "runs"), "PYTHONPATH": str(REPO)}

    def epd(self, *args, check=True) -> subprocess.CompletedProcess:
        result = subprocess.run([sys.executable, "-m", "ops.cli", *args], cwd=self.cwd, env=self.env,
                                capture_output=True, text=True, timeout=120)
        assert not check or result.returncode == 0, f"epd {args}: {result.stdout}\n{result.stderr}"
        return result

    def state(self) -> dict:
        return json.loads((self.cwd / "runs" / "current" / "state.json").read_text())

    def service(self, instance: str) -> dict:
        return next(s for s in self.state()["services"] if s["instance"] == instance)

    def events(self, instance: str) -> list[dict]:
        path = self.cwd / "runs" / "current" / "logs" / f"{instance}.log"
        return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]

    def kill_all(self) -> None:
        state_path = self.cwd / "runs" / "current" / "state.json"
        if state_path.exists():
            for pid in [self.state()["supervisor_pid"], *(s["pid"] for s in self.state()["services"])]:
                if pid and pid_alive(pid):
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def stack(tmp_path):
    runner = Stack(tmp_path)
    yield runner
    runner.kill_all()   # whatever a failing test left running


@pytest.mark.slow
def test_a_child_that_cannot_bind_is_reported_backs_off_and_recovers(stack, tmp_path):
    topology = write_topology(tmp_path / "t.toml", free_port_base(3))   # a hub and two echo workers
    stack.epd("up", "--detach", "--topology", str(topology))
    victim = stack.service("worker-1")
    address = victim["address"]
    supervisor = stack.state()["supervisor_pid"]
    os.kill(supervisor, signal.SIGSTOP)   # no restart can take the port before the squatter does
    try:
        os.kill(victim["pid"], signal.SIGKILL)
        wait_until(lambda: not pid_alive(victim["pid"]), 10, "worker-1 to die (its sockets close with it)",
                   poll_s=0.01)
        squatter = socket.socket()
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        wait_until(lambda: _bound(squatter, int(address.rpartition(":")[2])), 10, "the squatter to take the port")
    finally:
        os.kill(supervisor, signal.SIGCONT)
    with squatter:
        squatter.listen()

        def exits() -> list[dict]:
            return [e for e in stack.events("supervisor") if e["event"] == "service.exited"]
        wait_until(lambda: len(exits()) >= 3, 30, "worker-1 to fail at start twice", poll_s=0.2)
        killed, first, second = exits()[:3]
        assert (killed["code"], killed["reason"]) == (-9, "killed by SIGKILL")
        for failed in (first, second):
            assert failed["instance"] == "worker-1" and failed["code"] == 1
            assert f"cannot bind {address}: address already in use" in failed["reason"]
        assert [e["restart_in_s"] for e in (killed, first, second)] == [1.0, 2.0, 4.0]   # backing off

        out = (stack.cwd / "runs" / "current" / "supervisor.out").read_text()
        assert "epd: worker-1 (echo) exited with code 1 after " in out and f"cannot bind {address}" in out

        def shown_restarting():
            status = stack.epd("status", check=False)
            return status.returncode == 3 and "restarting" in status.stdout and status
        status = wait_until(shown_restarting, 30, "`epd status` to show worker-1 restarting", poll_s=0.2)
        assert f"worker-1: exited with code 1: epd serve: worker-1 (echo) exits 1: [Errno 98] cannot bind " \
               f"{address}: address already in use" in status.stdout
    wait_until(lambda: stack.epd("status", check=False).returncode == 0, 30,
               "worker-1 to run again once its port is free", poll_s=0.3)
    assert stack.service("worker-1")["state"] == "started"
    stack.epd("down")


@pytest.mark.slow
def test_ctrl_c_in_a_terminal_stops_the_stack_edge_inwards(stack, tmp_path):
    """A terminal's Ctrl-C signals the whole foreground process group: the services must not get
    it, or they stop all at once; the supervisor stops them wave by wave."""
    topology = tmp_path / "chain.toml"
    topology.write_text(f"""
[stack]
port_base = {free_port_base(3)}
grace_s = 3.0
[[service]]
name = "back"
kind = "echo"
[[service]]
name = "middle"
kind = "{RELAY}"
settings = {{ downstream = "@back" }}
[[service]]
name = "front"
kind = "{RELAY}"
settings = {{ downstream = "@middle" }}
""")
    up = subprocess.Popen([sys.executable, "-m", "ops.cli", "up", "--topology", str(topology)], cwd=stack.cwd,
                          env=stack.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)   # a process group of its own, as a terminal's job
    try:
        wait_until(lambda: (stack.cwd / "runs" / "current" / "state.json").exists()
                   and stack.state()["status"] == "ready", 60, "the stack to be ready")
        os.killpg(up.pid, signal.SIGINT)
        out, _ = up.communicate(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode == 0, out
    assert stack.state()["status"] == "stopped"

    def moment(instance: str, event: str) -> float:
        return next(e["ts"] for e in stack.events(instance) if e["event"] == event)
    assert moment("front-0", "service.stopped") < moment("middle-0", "service.draining")
    assert moment("middle-0", "service.stopped") < moment("back-0", "service.draining")
    waves = [e["services"] for e in stack.events("supervisor") if e["event"] == "stack.stopping"]
    assert waves == [["front"], ["middle"], ["back"]]


def _bound(sock: socket.socket, port: int) -> bool:
    """Bind `sock` to the port if the killed process's sockets have let go of it."""
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        return False
    return True
