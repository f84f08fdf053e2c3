"""The service shell in-process over real ZeroMQ (ipc): dispatch, typed errors for bad input,
handler failures, timeouts, the per-request summary line."""
from __future__ import annotations

import asyncio
import io
import json

import pytest
import structlog
import zmq
import zmq.asyncio

from messages import Codec
from messages.control import Echo, EchoReply, StatusQuery, StatusReply
from messages.errors import ErrorCode, ErrorReply, RemoteError, RequestTimeout
from messages.swa_registry import SwaLookup
from services.runtime.config import ServiceConfig
from services.runtime.logs import configure_logging
from services.runtime.service import Service


class TestHelperFaultyService(Service):
    """Test-only: a handler that raises a plain exception (a bug) on request."""

    kind = "test_helper_faulty"
    __test__ = False

    def handlers(self):
        return {Echo: self._maybe_fail}

    async def _maybe_fail(self, msg: Echo, ctx):
        if msg.payload == b"boom":
            raise RuntimeError("handler bug")
        return EchoReply(msg.payload, self.config.instance)


async def start(cls, tmp_path, name, **fields):
    svc = cls(ServiceConfig(kind=cls.kind, instance=name, bind=f"ipc://{tmp_path}/{name}.sock", **fields))
    task = asyncio.create_task(svc.run(install_signals=False))
    while svc.state == 0:    # STARTING; the loop yields until run() reaches RUNNING
        await asyncio.sleep(0)
        if task.done():
            raise AssertionError(f"{name} failed to start")
    return svc, task


@pytest.fixture
async def pair(tmp_path):
    server, server_task = await start(TestHelperFaultyService, tmp_path, "server")
    client, client_task = await start(Service, tmp_path, "client")
    yield server, client
    for svc, task in ((client, client_task), (server, server_task)):
        svc.stop()
        assert await task == 0


async def test_handler_reply_and_status(pair):
    server, client = pair
    env = await client.call(server.config.advertise, Echo(b"hi"), request_id="r1")
    assert env.message == EchoReply(b"hi", "server") and env.request_id == "r1"
    status = (await client.call(server.config.advertise, StatusQuery())).message
    assert isinstance(status, StatusReply) and status.instance == "server" and status.state == 1


async def test_handler_bug_becomes_internal_error_and_service_keeps_serving(pair):
    server, client = pair
    with pytest.raises(RemoteError) as err:
        await client.call(server.config.advertise, Echo(b"boom"), request_id="r2")
    assert err.value.code == ErrorCode.INTERNAL and "handler bug" in err.value.message
    env = await client.call(server.config.advertise, Echo(b"again"))
    assert env.message.payload == b"again"


async def test_known_type_the_service_does_not_handle_is_refused(pair):
    server, client = pair
    with pytest.raises(RemoteError) as err:
        await client.call(server.config.advertise, SwaLookup([b"h"]))
    assert err.value.code == ErrorCode.UNEXPECTED_MESSAGE


async def test_call_without_reply_times_out_typed(pair, tmp_path):
    _, client = pair
    with pytest.raises(RequestTimeout):
        await client.call(f"ipc://{tmp_path}/nobody.sock", Echo(b"x"), timeout=0.2)


@pytest.mark.parametrize("frames, code", [
    ([b"\x00"], ErrorCode.MALFORMED_FRAME),
    ([b"\xff\xff", b"\x90"], ErrorCode.UNKNOWN_MESSAGE_TYPE),
    ([b"\x01\x08", b"not msgpack"], ErrorCode.MALFORMED_FRAME),
])
async def test_corrupt_frames_get_a_typed_error_reply(pair, frames, code):
    server, _ = pair
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.config.advertise)
    try:
        await sock.send_multipart(frames)
        reply = Codec().decode(await asyncio.wait_for(sock.recv_multipart(), 5))
    finally:
        sock.close(0)
        ctx.term()
    assert isinstance(reply.message, ErrorReply) and reply.message.code == code
    assert server.state == 1


async def test_wrong_schema_version_is_refused(pair):
    server, _ = pair
    codec = Codec()
    frames = codec.encode(Echo(b"x"))
    header = codec._header_decoder.decode(frames[1])
    header.version = 99
    frames[1] = codec._encoder.encode(header)
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.config.advertise)
    try:
        await sock.send_multipart(frames)
        reply = codec.decode(await asyncio.wait_for(sock.recv_multipart(), 5))
    finally:
        sock.close(0)
        ctx.term()
    assert reply.message.code == ErrorCode.SCHEMA_VERSION_MISMATCH


async def test_one_summary_line_per_request_with_trace_fields(tmp_path):
    stream = io.StringIO()
    configure_logging("info", stream=stream)
    try:
        server, server_task = await start(TestHelperFaultyService, tmp_path, "server")
        client, client_task = await start(Service, tmp_path, "client")
        await client.call(server.config.advertise, Echo(b"x"), request_id="req-42")
        client.stop(), server.stop()
        await client_task, await server_task
    finally:
        structlog.reset_defaults()
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    summaries = [x for x in lines if x["event"] == "request.summary" and x.get("request_id") == "req-42"]
    assert len(summaries) == 1
    s = summaries[0]
    assert s["instance"] == "server" and s["sender"] == "client" and s["outcome"] == "ok"
    assert len(s["trace_id"]) == 32 and len(s["span_id"]) == 16
    assert s["handle_ms"] >= 0 and s["queue_ms"] >= 0


class TestHelperHookFailingService(Service):
    """Test-only: its on_peer_dead raises for the first dead peer (a bug) and records every call."""

    kind = "test_helper_hook_failing"
    __test__ = False

    def __init__(self, config):
        super().__init__(config)
        self.dead_seen: list[str] = []

    def on_peer_dead(self, peer) -> None:
        self.dead_seen.append(peer.instance)
        if len(self.dead_seen) == 1:
            raise RuntimeError("hook bug")


async def test_a_failing_peer_dead_hook_does_not_end_dead_peer_detection(tmp_path):
    from tests.helpers.test_helper_async import eventually
    fast = {"heartbeat_s": 0.05, "dead_after": 3}
    hub, hub_task = await start(TestHelperHookFailingService, tmp_path, "hub", **fast)
    members = [await start(Service, tmp_path, f"m{i}", upstream=hub.config.advertise, **fast) for i in range(2)]
    await eventually(lambda: len(hub.members.alive()) == 2, what="both registered")
    for i, (member, task) in enumerate(members):
        member.stop()
        assert await task == 0
        await eventually(lambda: len(hub.dead_seen) == i + 1, what=f"m{i} declared dead")
    assert hub.dead_seen == ["m0", "m1"]   # the first hook's exception did not stop the second
    hub.stop()
    assert await hub_task == 0


def test_logs_follow_stdout_as_it_is_when_written(monkeypatch):
    first, later = io.StringIO(), io.StringIO()
    monkeypatch.setattr("sys.stdout", first)
    configure_logging("info")   # configured while `first` is stdout (a test's capture, say) ...
    try:
        monkeypatch.setattr("sys.stdout", later)
        first.close()   # ... which is then closed: logging must neither fail nor write there
        structlog.get_logger().info("after.swap", n=1)
    finally:
        structlog.reset_defaults()
    assert json.loads(later.getvalue())["event"] == "after.swap"
