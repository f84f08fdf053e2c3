"""`epd tap` on a CURVE stack: with the stack's keys it serves and relays over CURVE (and shows the
decoded frames); a client without the keys never gets a frame set in."""
from __future__ import annotations

import asyncio
import io
import threading

import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from messages import Codec
from messages.control import Echo, EchoReply
from ops.keys_command import write_keys
from ops.tap import Tap, TapError
from services.runtime.config import ServiceConfig
from services.runtime.curve import connect_curve, load_keys
from services.runtime.service import Service

TIMEOUT_S = 10


def refused_plain_client(ctx: zmq.Context, address: str) -> None:
    """A plain DEALER sends to the CURVE tap; returns once its handshake has failed."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                      | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
    try:
        sock.connect(address)
        sock.send_multipart(Codec(sender="intruder").encode(Echo(b"intruder")))
        assert monitor.poll(TIMEOUT_S * 1000), "no handshake outcome"
        assert recv_monitor_message(monitor)["event"] != zmq.EVENT_HANDSHAKE_SUCCEEDED
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)


async def test_tap_with_keys_relays_a_curve_link_and_refuses_a_plain_client(tmp_path):
    write_keys(tmp_path / "keys")
    keys = load_keys(tmp_path / "keys")
    service = Service(ServiceConfig(kind="echo", instance="e", bind=f"ipc://{tmp_path}/svc",
                                    keys_dir=str(tmp_path / "keys")))
    service_task = asyncio.create_task(service.run(install_signals=False))
    out = io.StringIO()
    tap = Tap(f"ipc://{tmp_path}/tap", forward=f"ipc://{tmp_path}/svc", count=2, out=out, keys=keys)
    tap.open()
    tap_task = asyncio.create_task(tap.run())
    sync_ctx, ctx = zmq.Context(), zmq.asyncio.Context()
    codec = Codec(sender="client")
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    connect_curve(client, keys)
    try:
        await asyncio.to_thread(refused_plain_client, sync_ctx, tap.bound)
        client.connect(tap.bound)
        await client.send_multipart(codec.encode(Echo(b"secret"), request_id="r-1"))
        reply = codec.decode(await asyncio.wait_for(client.recv_multipart(copy=False), TIMEOUT_S))
        assert await asyncio.wait_for(tap_task, TIMEOUT_S) == 2
    finally:
        tap_task.cancel()
        client.close(0)
        ctx.term()
        sync_ctx.term()
        service.stop()
        await asyncio.wait_for(service_task, TIMEOUT_S)
    assert reply.message == EchoReply(b"secret", "e")
    printed = out.getvalue()
    assert "    body: {'payload': b'secret', 'delay_ms': 0.0}" in printed      # the tap sees the plaintext
    assert "EchoReply(0x0109) req=r-1 from=e" in printed
    assert "intruder" not in printed


def test_a_tap_needs_the_server_secret_and_leaves_no_thread_without_it(tmp_path):
    write_keys(tmp_path / "keys")
    before = threading.active_count()
    with pytest.raises(TapError, match="server.key_secret"):
        Tap(f"ipc://{tmp_path}/tap", keys=load_keys(tmp_path / "keys", server=False)).open()
    assert threading.active_count() == before   # the ZAP thread it had started is gone
