"""`epd up / status / down` as a user runs them: real processes, real sockets, nothing left behind."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from ops.topology import load_topology
from tests.helpers.test_helper_processes import REPO, wait_until
from tests.helpers.test_helper_stack import free_port_base, link_model, pid_alive

pytestmark = pytest.mark.slow   # starts service processes

RELAY = "tests.helpers.test_helper_relay:TestHelperRelay"


class Epd:
    def __init__(self, cwd: Path):
        self.cwd = cwd
        self.env = {**os.environ, "EPD_RUN_ROOT": str(cwd / "runs"), "PYTHONPATH": str(REPO)}

    def __call__(self, *args, timeout=120, check=True) -> subprocess.CompletedProcess:
        result = subprocess.run([sys.executable, "-m", "ops.cli", *args], cwd=self.cwd, env=self.env,
                                capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"epd {' '.join(args)} -> {result.returncode}\n{result.stdout}\n{result.stderr}")
        return result

    def state(self) -> dict:
        return json.loads((self.cwd / "runs" / "current" / "state.json").read_text())


@pytest.fixture
def epd(tmp_path):
    runner = Epd(tmp_path)
    yield runner
    # whatever a failing test left running goes now
    state_path = tmp_path / "runs" / "current" / "state.json"
    if state_path.exists():
        state = json.loads(state_path.read_text())
        for pid in [state["supervisor_pid"], *(s["pid"] for s in state["services"])]:
            if pid and pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def write_topology(path: Path, port_base: int) -> Path:
    path.write_text(f"""
[stack]
port_base = {port_base}
grace_s = 3.0
[[service]]
name = "hub"
kind = "echo"
heartbeat_s = 0.5
[[service]]
name = "worker"
kind = "echo"
replicas = 2
upstream = "hub"
heartbeat_s = 0.5
""")
    return path


def test_default_stack_up_status_down_leaves_no_process(epd, tiny_v41_model_dir):
    link_model(epd.cwd, tiny_v41_model_dir)
    http_port = free_port_base(1, offset=0)
    up = epd("up", "--detach", "--port-base", str(free_port_base(len(load_topology().instances()))),
             "--http-port", str(http_port))
    assert "stack ready" in up.stdout and "curl http://127.0.0.1:" in up.stdout
    status = json.loads(epd("status", "--json").stdout)
    assert status["supervisor"] == "ready"
    assert all(s["state"] == "running" for s in status["services"])
    peers = {s["kind"]: s["peers"] for s in status["services"]}   # the default is the E/P/D form
    assert set(peers) == {"gateway", "grammar_compiler", "prefill_router", "prefill_worker", "decode_router",
                          "decode_worker", "kv_writer", "swa_registry", "vision_balancer", "vision_worker"}
    assert peers["prefill_router"] == "2/2" and peers["decode_router"] == "1/1"   # gateway + prefill worker; decode worker
    assert peers["gateway"] == "2/2"   # the grammar compiler and the vision balancer register with the gateway
    assert peers["vision_balancer"] == "1/1"   # its vision worker
    body = {"model": "deepseek-v41-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:   # prefill worker -> decode worker
        assert json.loads(response.read())["usage"]["completion_tokens"] == 3
    state = epd.state()
    pids = [state["supervisor_pid"], *(s["pid"] for s in state["services"])]
    assert all(pid_alive(p) for p in pids)
    down = epd("down")
    assert "stack stopped" in down.stdout
    assert not any(pid_alive(p) for p in pids)
    assert epd.state()["status"] == "stopped"


def test_status_shows_heartbeats_and_supervisor_restarts_a_killed_service(epd, tmp_path):
    topology = write_topology(tmp_path / "t.toml", free_port_base(3))
    epd("up", "--detach", "--topology", str(topology))
    status = json.loads(epd("status", "--json").stdout)
    workers = [s for s in status["services"] if s["instance"].startswith("worker")]
    assert [s["last_heartbeat"].endswith("s ago") for s in workers] == [True, True]
    hub = next(s for s in status["services"] if s["instance"] == "hub-0")
    assert hub["peers"] == "2/2"
    victim = next(s for s in epd.state()["services"] if s["instance"] == "worker-1")
    os.kill(victim["pid"], signal.SIGKILL)

    def restarted():
        svc = next(s for s in epd.state()["services"] if s["instance"] == "worker-1")
        if svc["restarts"] < 1 or not svc["pid"] or svc["pid"] == victim["pid"]:
            return False
        return epd("status", "--json", check=False).returncode == 0
    wait_until(restarted, 30, "worker-1 to be restarted and running again", poll_s=0.3)
    epd("down")


def test_foreground_up_stops_everything_on_ctrl_c(epd, tmp_path):
    topology = write_topology(tmp_path / "t.toml", free_port_base(3))
    proc = subprocess.Popen([sys.executable, "-m", "ops.cli", "up", "--topology", str(topology)],
                            cwd=epd.cwd, env=epd.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: (epd.cwd / "runs" / "current" / "state.json").exists()
                   and epd.state()["status"] == "ready", 60, "the stack to be ready")
        pids = [s["pid"] for s in epd.state()["services"]]
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "stack ready" in out and "epd down" in out
    assert not any(pid_alive(p) for p in pids)


def test_up_refuses_a_port_in_use_with_a_clear_message(epd, tmp_path):
    base = free_port_base(3)
    topology = write_topology(tmp_path / "t.toml", base)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", base + 1))
        squatter.listen()
        result = epd("up", "--detach", "--topology", str(topology), check=False)
    assert result.returncode == 1
    assert f"127.0.0.1:{base + 1}" in result.stderr and "in use" in result.stderr


def test_trace_rebuilds_a_request_across_three_processes(epd, tmp_path):
    base = free_port_base(3)
    topology = tmp_path / "chain.toml"
    topology.write_text(f"""
[stack]
port_base = {base}
grace_s = 3.0
[[service]]
name = "front"
kind = "{RELAY}"
settings = {{ downstream = "@middle" }}     # a named peer: the launcher fills in its address
[[service]]
name = "middle"
kind = "{RELAY}"
settings = {{ downstream = "@back" }}
[[service]]
name = "back"
kind = "echo"
""")
    epd("up", "--detach", "--topology", str(topology))
    try:
        from messages.control import Echo, EchoReply
        import zmq
        from messages import Codec
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{base}")
        sock.send_multipart(Codec("test-client").encode(Echo(b"hop"), request_id="req-chain-1"))
        assert sock.poll(10_000)
        reply = Codec().decode(sock.recv_multipart())
        sock.close(0)
        ctx.term()
        assert isinstance(reply.message, EchoReply) and reply.message.handled_by == "back-0"
    finally:
        epd("down")
    trace = epd("trace", "req-chain-1")
    for instance in ("front-0", "middle-0", "back-0"):
        assert instance in trace.stdout
    chrome = tmp_path / "trace.json"
    epd("trace", "req-chain-1", "--chrome", str(chrome))
    events = json.loads(chrome.read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    assert len({e["pid"] for e in spans}) == 3
    trace_ids = {e.get("args", {}).get("trace_id") for e in spans}
    assert len(trace_ids) == 1   # one trace, three processes
