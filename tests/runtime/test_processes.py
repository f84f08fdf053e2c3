"""Multi-process behaviour over real ZeroMQ sockets: buffers intact, dead peers detected,
drain on SIGTERM, overload answered, reconnect after an upstream restart."""
from __future__ import annotations

import signal
import time

import pytest
import torch
import zmq

from messages import Codec
from messages.control import Echo, EchoReply, ServiceState
from messages.errors import ErrorCode, ErrorReply
from services.workers.tensors import to_frame, torch_frame
from tests.helpers.test_helper_processes import procs, tcp_config, wait_until  # noqa: F401 - procs is a fixture

pytestmark = pytest.mark.slow   # starts service processes

RELAY = "tests.helpers.test_helper_relay:TestHelperRelay"


class SyncClient:
    """A plain DEALER speaking our envelope, to drive services from the test process."""

    def __init__(self, address: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.codec = Codec(sender="test-client")

    def send(self, message, **kw) -> str:
        frames = self.codec.encode(message, **kw)
        self.sock.send_multipart(frames, copy=False)
        return self.codec._header_decoder.decode(frames[1]).msg_id

    def recv(self, timeout_s: float = 10.0):
        assert self.sock.poll(int(timeout_s * 1000)), f"no reply within {timeout_s}s"
        return self.codec.decode(self.sock.recv_multipart(copy=False))

    def close(self):
        self.sock.close(0)
        self.ctx.term()


def test_tensor_buffers_arrive_intact_across_processes(procs):
    echo = procs(tcp_config("echo", "echo-0"))
    echo.wait_running()
    tensors = [torch.randn(64, 512, dtype=torch.bfloat16), torch.randn(3, 5, 7),
               torch.arange(1000, dtype=torch.int64), torch.randint(0, 255, (1 << 20,), dtype=torch.uint8),
               torch.empty(0, 4)]
    client = SyncClient(echo.address)
    try:
        client.send(Echo(b"payload"), request_id="r-tensors", buffers=[to_frame(t) for t in tensors])
        reply = client.recv()
    finally:
        client.close()
    assert isinstance(reply.message, EchoReply) and reply.message.payload == b"payload"
    assert reply.request_id == "r-tensors"
    for i, sent in enumerate(tensors):
        got = torch_frame(reply, i)
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got.view(torch.uint8) if got.numel() else got, sent.view(torch.uint8) if sent.numel() else sent)


def test_sigkill_peer_is_declared_dead_within_5s(procs):
    hub = procs(tcp_config("echo", "hub-0", heartbeat_s=1.0, dead_after=3))
    hub.wait_running()
    worker = procs(tcp_config("echo", "worker-0", upstream=hub.address))
    worker.wait_running(upstream=True)
    wait_until(lambda: any(p.instance == "worker-0" and p.alive for p in hub.status().peers), 10, "registration")
    worker.proc.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(lambda: any(p.instance == "worker-0" and not p.alive for p in hub.status().peers), 10,
               "the hub to declare worker-0 dead")
    assert time.monotonic() - killed_at < 5.0
    assert '"event": "peer.dead"' in hub.log()


def test_work_held_by_a_killed_peer_fails_with_peer_dead(procs):
    hub = procs(tcp_config(RELAY, "relay-0", heartbeat_s=0.5, dead_after=3))
    hub.wait_running()
    worker = procs(tcp_config("echo", "worker-0", upstream=hub.address, heartbeat_s=0.5))
    worker.wait_running(upstream=True)
    client = SyncClient(hub.address)
    try:
        client.send(Echo(b"slow", delay_ms=60_000), request_id="r-held")
        wait_until(lambda: worker.status().load.in_flight == 1, 10, "the worker to hold the request")
        worker.proc.send_signal(signal.SIGKILL)
        reply = client.recv(timeout_s=10)
    finally:
        client.close()
    assert isinstance(reply.message, ErrorReply)
    assert reply.message.code == ErrorCode.PEER_DEAD
    assert reply.request_id == "r-held"
    assert hub.status().load.in_flight == 0


def test_sigterm_drains_in_flight_work_before_exit(procs):
    echo = procs(tcp_config("echo", "echo-0", grace_s=20.0))
    echo.wait_running()
    client = SyncClient(echo.address)
    try:
        for i in range(5):
            client.send(Echo(f"job{i}".encode(), delay_ms=1500), request_id=f"r{i}")
        wait_until(lambda: echo.status().load.in_flight == 5, 10, "5 requests in flight")
        echo.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: (s := echo.status()) and s.state == ServiceState.DRAINING, 5, "DRAINING")
        client.send(Echo(b"late"), request_id="r-late")
        replies = {}
        for _ in range(6):
            env = client.recv(timeout_s=15)
            replies[env.request_id] = env.message
    finally:
        client.close()
    assert replies["r-late"].code == ErrorCode.DRAINING
    assert all(isinstance(replies[f"r{i}"], EchoReply) and replies[f"r{i}"].payload == f"job{i}".encode()
               for i in range(5))
    assert echo.proc.wait(timeout=15) == 0
    assert '"event": "service.drained"' in echo.log()


def test_overload_is_an_explicit_error_reply(procs):
    echo = procs(tcp_config("echo", "echo-0", concurrency=1, queue_size=2))
    echo.wait_running()
    client = SyncClient(echo.address)
    try:
        for i in range(8):
            client.send(Echo(b"x", delay_ms=300), request_id=f"r{i}")
        outcomes = [client.recv(timeout_s=15).message for _ in range(8)]
    finally:
        client.close()
    overloaded = [m for m in outcomes if isinstance(m, ErrorReply)]
    served = [m for m in outcomes if isinstance(m, EchoReply)]
    assert overloaded and all(m.code == ErrorCode.OVERLOADED for m in overloaded)
    # a queue of 2, plus the one the handler may already have taken: the rest are refused at once
    assert 2 <= len(served) <= 3
    assert len(served) + len(overloaded) == 8


def test_worker_reregisters_after_its_upstream_restarts(procs):
    hub_config = tcp_config("echo", "hub-0", heartbeat_s=0.3)
    hub = procs(hub_config)
    hub.wait_running()
    worker = procs(tcp_config("echo", "worker-0", upstream=hub.address, heartbeat_s=0.3))
    worker.wait_running(upstream=True)
    hub.proc.send_signal(signal.SIGKILL)
    hub.proc.wait()
    wait_until(lambda: not worker.status().upstream_connected, 10, "the worker to notice its upstream died")
    hub2 = procs(hub_config)   # same address, fresh process: knows nobody
    hub2.wait_running()
    wait_until(lambda: any(p.instance == "worker-0" and p.alive for p in hub2.status().peers), 20,
               "the worker to register with the restarted hub")
    assert '"event": "upstream.lost"' in worker.log() or '"event": "upstream.unreachable"' in worker.log()
