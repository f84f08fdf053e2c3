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


class TestHelperGatedService(Service):
    """Test-only: Echo handlers that wait for a gate (an asyncio.Event) before answering, logging
    on both sides of the wait; records the order in which handlers started."""

    kind = "test_helper_gated"
    __test__ = False

    def __init__(self, config):
        super().__init__(config)
        self.gate = asyncio.Event()
        self.started: list[bytes] = []

    def handlers(self):
        return {Echo: self._gated}

    async def _gated(self, msg: Echo, ctx):
        self.started.append(msg.payload)
        self.log.info("gated.before")
        await self.gate.wait()
        self.log.info("gated.after", payload=msg.payload.decode())
        return EchoReply(msg.payload, self.config.instance)


async def test_concurrency_limit_backlog_and_overload_in_order(tmp_path):
    server, server_task = await start(TestHelperGatedService, tmp_path, "gated", concurrency=2, queue_size=2)
    client, client_task = await start(Service, tmp_path, "client")
    from tests.helpers.test_helper_async import eventually
    try:
        calls = [asyncio.create_task(client.call(server.config.advertise, Echo(f"m{i}".encode()), request_id=f"r{i}"))
                 for i in range(6)]
        await eventually(lambda: sum(c.done() for c in calls) == 2, what="two refusals")
        assert server.started == [b"m0", b"m1"]   # two handlers run, two wait in the backlog
        assert server.load().queue_depth == 2 and server.in_flight() == 4
        server.gate.set()
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
    finally:
        client.stop(), server.stop()
        await client_task, await server_task
    refused = [o for o in outcomes if isinstance(o, RemoteError)]
    assert len(refused) == 2 and all(o.code == ErrorCode.OVERLOADED for o in refused)
    assert [o.message.payload for o in outcomes if not isinstance(o, BaseException)] == [b"m0", b"m1", b"m2", b"m3"]
    assert server.started == [b"m0", b"m1", b"m2", b"m3"]
    assert server.in_flight() == 0 and server.load().queue_depth == 0


async def test_a_handler_that_suspends_keeps_its_log_fields_and_they_do_not_leak(tmp_path):
    stream = io.StringIO()
    configure_logging("info", stream=stream)
    try:
        server, server_task = await start(TestHelperGatedService, tmp_path, "gated")
        client, client_task = await start(Service, tmp_path, "client")
        server.gate.set()
        for i in range(3):
            await client.call(server.config.advertise, Echo(f"p{i}".encode()), request_id=f"req-{i}")
        client.stop(), server.stop()
        await client_task, await server_task
    finally:
        structlog.reset_defaults()
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    for i in range(3):
        mine = [x for x in lines if x.get("request_id") == f"req-{i}" and x["instance"] == "gated"]
        assert [x["event"] for x in mine] == ["gated.before", "gated.after", "request.summary"]
        assert mine[1]["payload"] == f"p{i}" and len({x["trace_id"] for x in mine}) == 1
    assert all("request_id" not in x for x in lines if x["event"].startswith("service."))


async def test_stop_cancels_handlers_that_wait(tmp_path):
    server, server_task = await start(TestHelperGatedService, tmp_path, "gated")
    client, client_task = await start(Service, tmp_path, "client")
    call = asyncio.create_task(client.call(server.config.advertise, Echo(b"w"), request_id="r-w", timeout=1))
    from tests.helpers.test_helper_async import eventually
    await eventually(lambda: server.in_flight() == 1, what="the handler to wait")
    server.stop()
    assert await asyncio.wait_for(server_task, 5) == 0
    with pytest.raises(RequestTimeout):
        await call
    client.stop()
    assert await client_task == 0


async def test_call_timeouts_of_different_lengths_share_one_timer(pair, tmp_path):
    server, client = pair
    loop = asyncio.get_running_loop()
    nobody = f"ipc://{tmp_path}/nobody.sock"
    long_call = asyncio.create_task(client.call(nobody, Echo(b"long"), timeout=1.0))
    await asyncio.sleep(0.01)
    t0 = loop.time()
    with pytest.raises(RequestTimeout):   # a shorter deadline than the armed one re-arms the timer
        await client.call(nobody, Echo(b"short"), timeout=0.2)
    assert 0.15 < loop.time() - t0 < 0.7
    assert not long_call.done()
    assert (await client.call(server.config.advertise, Echo(b"ok"), timeout=5)).message.payload == b"ok"
    with pytest.raises(RequestTimeout):
        await long_call
    assert 0.8 < loop.time() - t0 < 2.0
    assert len(client._calls) == 0


async def test_message_metrics_in_the_exposition(pair):
    server, client = pair
    for _ in range(3):
        await client.call(server.config.advertise, Echo(b"m"))
    with pytest.raises(RemoteError):
        await client.call(server.config.advertise, Echo(b"boom"))
    labels = {"kind": server.kind, "instance": "server"}
    value = server.metrics.registry.get_sample_value
    assert value("epd_messages_in_total", {**labels, "type": "Echo"}) == 4
    assert value("epd_messages_out_total", {**labels, "type": "EchoReply"}) == 3
    assert value("epd_messages_out_total", {**labels, "type": "ErrorReply"}) == 1
    assert value("epd_errors_total", {**labels, "code": "INTERNAL"}) == 1
    assert value("epd_handle_seconds_count", {**labels, "type": "Echo"}) == 4
    assert value("epd_handle_seconds_bucket", {**labels, "type": "Echo", "le": "+Inf"}) == 4
    assert 0 < value("epd_handle_seconds_sum", {**labels, "type": "Echo"}) < 4
    text = server.metrics.exposition().decode()
    assert 'epd_messages_in_total{instance="server",kind="test_helper_faulty",type="Echo"} 4.0' in text
    assert value("epd_messages_in_total", {"kind": "echo", "instance": "client", "type": "EchoReply"}) is None
    assert client.metrics.registry.get_sample_value(
        "epd_messages_in_total", {"kind": "echo", "instance": "client", "type": "EchoReply"}) == 3


def test_histogram_buckets_are_upper_inclusive():
    from services.runtime.metrics import ServiceMetrics
    m = ServiceMetrics("k", "i")
    for seconds in (0.0001, 0.00010001, 0.2, 31.0):
        m.observe("T", seconds)
    value = lambda le: m.registry.get_sample_value("epd_handle_seconds_bucket", {"kind": "k", "instance": "i", "type": "T", "le": le})  # noqa: E731
    assert (value("0.0001"), value("0.00025"), value("0.25"), value("30.0"), value("+Inf")) == (1, 2, 3, 3, 4)


class TestHelperTaskNeedingService(Service):
    """Test-only: an Echo handler that needs its own task at once (asyncio.timeout)."""

    kind = "test_helper_task_needing"
    __test__ = False

    def handlers(self):
        return {Echo: self._timed}

    async def _timed(self, msg: Echo, ctx):
        async with asyncio.timeout(5):   # RuntimeError outside a task
            await asyncio.sleep(0)
        return EchoReply(msg.payload, self.config.instance)


class TestHelperYieldingService(Service):
    """Test-only: an Echo handler that yields to the loop and uses wait_for first."""

    kind = "test_helper_yielding"
    __test__ = False

    def handlers(self):
        return {Echo: self._yielding}

    async def _yielding(self, msg: Echo, ctx):
        await asyncio.wait_for(asyncio.sleep(0.001), 5)
        await asyncio.sleep(0)
        return EchoReply(msg.payload, self.config.instance)


@pytest.mark.parametrize("cls", [TestHelperTaskNeedingService, TestHelperYieldingService])
async def test_handlers_that_suspend_or_need_their_task(cls, tmp_path):
    server, server_task = await start(cls, tmp_path, "s")
    client, client_task = await start(Service, tmp_path, "client")
    try:
        replies = await asyncio.gather(*(client.call(server.config.advertise, Echo(f"{i}".encode()), request_id=f"r{i}")
                                         for i in range(20)))
    finally:
        client.stop(), server.stop()
        await client_task, await server_task
    assert [r.message.payload for r in replies] == [f"{i}".encode() for i in range(20)]
    assert server.in_flight() == 0 and not server._handler_tasks


async def test_background_work_logs_its_failure_and_is_cancelled_at_stop(tmp_path):
    stream = io.StringIO()
    configure_logging("info", stream=stream)
    try:
        svc, task = await start(Service, tmp_path, "bg")
        started = asyncio.Event()

        async def fails():
            raise RuntimeError("background bug")

        async def runs_forever():
            started.set()
            await asyncio.Event().wait()

        failing = svc.in_background(fails(), "bg.failed", level="warning")
        forever = svc.in_background(runs_forever(), "bg.forever_failed")
        await asyncio.gather(failing, return_exceptions=True)
        await started.wait()
        svc.stop()
        assert await task == 0
    finally:
        structlog.reset_defaults()
    assert forever.cancelled() and not svc._background
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    failures = [x for x in lines if x["event"] in ("bg.failed", "bg.forever_failed")]
    assert [(x["event"], x["level"]) for x in failures] == [("bg.failed", "warning")]
    assert "background bug" in failures[0]["error"]
