"""`epd tap`: frame sets printed as decoded by plain msgpack, malformed input shown, relaying works."""
from __future__ import annotations

import asyncio
import io

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio

from messages import SCHEMA_VERSION, Codec
from messages.control import Echo, EchoReply, Heartbeat, Load
from messages.tensors import TensorDesc
from ops.tap import Tap, describe_frames, tap
from services.runtime.config import ServiceConfig
from services.runtime.service import Service

TIMEOUT_S = 10


def _echo_frames(codec: Codec) -> list:
    tensor = np.arange(6, dtype=np.float32).reshape(2, 3)
    return codec.encode(Echo(b"hello", 1.5), request_id="req-7", traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01",
                        buffers=[tensor], msg_id="m-1")


def test_describe_names_the_type_header_body_and_buffers():
    summary, details = describe_frames(_echo_frames(Codec(sender="client")))
    assert summary == "Echo(0x0108) req=req-7 from=client msg=m-1 1 buf 24 B"
    header = details[0]
    assert header.startswith(f"header: version={SCHEMA_VERSION} msg_id='m-1' request_id='req-7' traceparent='00-aaaa")
    assert "sender='client'" in header and "sent_at=" in header and "in_reply_to=''" in header
    assert details[1] == "body: {'payload': b'hello', 'delay_ms': 1.5}"
    assert details[2] == "buffer[0]: float32[2, 3] 24 bytes"


def test_describe_names_nested_struct_fields():
    _, details = describe_frames(Codec(sender="w").encode(Heartbeat("w-1", 3, 1, Load(queue_depth=2))))
    assert "'load': {'queue_depth': 2, 'in_flight': 0" in details[1]


@pytest.mark.parametrize("frames, expected", [
    ([b"\x01"], "MALFORMED 1 frame(s)"),
    ([b"\x01\x08\x00", msgpack.packb([1])], "problem: tag: must be 2 bytes, got 01 08 00 (3 bytes)"),
    ([b"\x01\x08", b"\xc1\xc1garbage"], "problem: header: "),
    ([b"\x01\x08", msgpack.packb({"not": "a header"})], "expected an array of 8 or 9 fields"),
    ([b"\xf0\xff", msgpack.packb([SCHEMA_VERSION, "m", "r", "", "s", 0.0, [], [], ""])], "UNKNOWN(0xf0ff)"),
    ([b"\x01\x08", msgpack.packb([SCHEMA_VERSION + 1, "m", "r", "", "s", 0.0, [], [], ""])],
     f"this build speaks {SCHEMA_VERSION}"),
    ([b"\x01\x08", msgpack.packb([SCHEMA_VERSION, "m", "r", "", "s", 0.0, [["float32", [4]]], [], ""]), b"xx"],
     "MISMATCH: descriptor needs 16 bytes"),
])
def test_describe_shows_malformed_frames_with_the_reason(frames, expected):
    summary, details = describe_frames(frames)
    assert summary.startswith("MALFORMED") or "UNKNOWN" in summary
    assert expected in summary + "\n" + "\n".join(details)


def test_describe_shows_undecodable_header_as_hex():
    _, details = describe_frames([b"\x01\x08", b"\xc1\xc1garbage"])
    assert "c1 c1 67 61 72 62 61 67 65 (9 bytes)" in details[0]


def _client(ctx: zmq.asyncio.Context, address: str) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


@pytest.fixture
def zmq_ctx():
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def test_tap_prints_a_real_message_and_malformed_frame_sets(tmp_path, zmq_ctx):
    out = io.StringIO()
    tap = Tap(f"ipc://{tmp_path}/tap", count=2, out=out)
    tap.open()
    client = _client(zmq_ctx, tap.bound)
    await client.send_multipart(_echo_frames(Codec(sender="client")))
    await client.send_multipart([b"\x01\x08", b"\xc1not msgpack"])
    assert await asyncio.wait_for(tap.run(), TIMEOUT_S) == 2
    lines = out.getvalue().splitlines()
    assert "#1 -> " in lines[0] and lines[0].endswith("Echo(0x0108) req=req-7 from=client msg=m-1 1 buf 24 B")
    assert "    body: {'payload': b'hello', 'delay_ms': 1.5}" in lines
    assert "    buffer[0]: float32[2, 3] 24 bytes" in lines
    second = next(line for line in lines if "#2 -> " in line)
    assert second.endswith("MALFORMED Echo(0x0108) no buffers")
    assert any(line.startswith("    problem: header: ") and "c1 6e 6f 74" in line for line in lines)


async def test_tap_forwards_to_a_service_and_prints_the_reply(tmp_path, zmq_ctx):
    service = Service(ServiceConfig(kind="echo", instance="e", bind=f"ipc://{tmp_path}/svc"))
    service_task = asyncio.create_task(service.run(install_signals=False))
    out = io.StringIO()
    tap = Tap(f"ipc://{tmp_path}/tap", forward=f"ipc://{tmp_path}/svc", count=2, out=out)
    tap.open()
    tap_task = asyncio.create_task(tap.run())
    codec = Codec(sender="client")
    client = _client(zmq_ctx, tap.bound)
    try:
        await client.send_multipart(_echo_frames(codec))
        reply = codec.decode(await asyncio.wait_for(client.recv_multipart(copy=False), TIMEOUT_S))
        assert await asyncio.wait_for(tap_task, TIMEOUT_S) == 2
    finally:
        tap_task.cancel()
        service.stop()
        await asyncio.wait_for(service_task, TIMEOUT_S)
    assert reply.message == EchoReply(b"hello", "e")
    assert reply.header.in_reply_to == "m-1" and reply.request_id == "req-7"
    desc, view = reply.frame(0)
    assert desc == TensorDesc("float32", (2, 3)) and view == np.arange(6, dtype=np.float32).tobytes()
    lines = out.getvalue().splitlines()
    request = next(line for line in lines if "#1 -> " in line)
    answer = next(line for line in lines if "#2 <- " in line)
    assert request.split(" -> ")[1].split()[0] == answer.split(" <- ")[1].split()[0]   # same client identity
    assert answer.endswith("EchoReply(0x0109) req=req-7 from=e msg=" + reply.header.msg_id
                           + " reply_to=m-1 1 buf 24 B")
    assert "    body: {'payload': b'hello', 'handled_by': 'e'}" in lines


async def test_tap_reports_an_address_it_cannot_bind(tmp_path):
    from ops.tap import TapError
    with pytest.raises(TapError, match="cannot bind"):
        Tap("bogus://nowhere").open()


def test_describe_truncates_long_bytes_in_the_body():
    _, details = describe_frames(Codec().encode(Echo(b"x" * 100)))
    assert details[1] == "body: {'payload': b'" + "x" * 32 + "'...(100 bytes), 'delay_ms': 0.0}"


async def test_tap_function_runs_until_count_and_returns_it(tmp_path, zmq_ctx):
    out = io.StringIO()
    address = f"ipc://{tmp_path}/tap"
    client = _client(zmq_ctx, address)                     # connecting first is fine: frames wait
    await client.send_multipart(Codec(sender="client").encode(Echo(b"hi"), request_id="r"))
    assert await asyncio.wait_for(tap(address, count=1, out=out, detail=False), TIMEOUT_S) == 1
    assert out.getvalue().count("\n") == 1 and "Echo(0x0108) req=r from=client" in out.getvalue()
