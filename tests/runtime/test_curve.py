"""CURVE on the runtime's sockets, in-process over real ZeroMQ (ipc): services holding one stack's
keys talk; a peer without them (no keys, an unknown client key, another server key) never reaches
a handler; a bad keys dir fails the start naming the file; the ZAP thread ends with the service."""
from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from messages import Codec
from messages.control import Echo, EchoReply
from messages.errors import RequestTimeout
from ops.keys_command import write_keys
from services.runtime import curve
from services.runtime.config import ServiceConfig
from services.runtime.curve import KeysError, load_keys
from services.runtime.service import Service

HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class TestHelperRecordingService(Service):
    """Test-only: an echo service that records every Echo payload its handler saw."""

    kind = "test_helper_recording"
    __test__ = False

    def __init__(self, config):
        super().__init__(config)
        self.received: list[bytes] = []

    def handlers(self):
        return {Echo: self._record}

    async def _record(self, msg: Echo, ctx):
        self.received.append(msg.payload)
        return EchoReply(msg.payload, self.config.instance)


@pytest.fixture
def keys_dir(tmp_path) -> Path:
    write_keys(tmp_path / "keys")
    return tmp_path / "keys"


async def start(cls, tmp_path, name, **fields):
    svc = cls(ServiceConfig(kind=cls.kind, instance=name, bind=f"ipc://{tmp_path}/{name}.sock", **fields))
    task = asyncio.create_task(svc.run(install_signals=False))
    while svc.state == 0:   # STARTING
        await asyncio.sleep(0)
        if task.done():
            raise AssertionError(f"{name} failed to start: {svc.failure}")
    return svc, task


async def stop(*pairs) -> None:
    for svc, task in pairs:
        svc.stop()
        assert await task == 0


def auth_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if type(t).__name__ == "AuthenticationThread" and t.is_alive()]


async def test_two_services_with_the_same_keys_call_each_other_and_register(tmp_path, keys_dir):
    hub, hub_task = await start(Service, tmp_path, "hub", keys_dir=str(keys_dir), heartbeat_s=0.2)
    worker, worker_task = await start(Service, tmp_path, "worker", keys_dir=str(keys_dir), heartbeat_s=0.2,
                                      upstream=hub.config.advertise)
    try:
        assert hub.sockets.curve is not None and worker.sockets.curve is not None
        assert hub.inbox.sock.getsockopt(zmq.MECHANISM) == zmq.CURVE
        reply = await worker.call(hub.config.advertise, Echo(b"over curve"))
        assert reply.message.payload == b"over curve"
        back = await hub.call(worker.config.advertise, Echo(b"and back"))
        assert back.message.payload == b"and back"
        while not hub.members.get("worker"):   # registration rides the same CURVE link
            await asyncio.sleep(0.01)
    finally:
        await stop((worker, worker_task), (hub, hub_task))


def bad_dealer(ctx: zmq.Context, address: str, *, public=None, secret=None, server=None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if public is not None:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server
    return sock


def first_handshake_event(monitor: zmq.Socket, timeout_s: float = 10.0) -> tuple[int, int]:
    """The first handshake outcome the monitored socket reports: (event, value)."""
    if not monitor.poll(int(timeout_s * 1000)):
        raise AssertionError(f"no handshake outcome within {timeout_s}s")
    event = recv_monitor_message(monitor)
    return event["event"], event["value"]


def other_stack_keys(tmp_path: Path, name: str):
    write_keys(tmp_path / name)
    return load_keys(tmp_path / name)


@pytest.mark.parametrize("peer", ["no keys", "unknown client key", "wrong server key"])
async def test_a_peer_without_the_stacks_keys_never_reaches_a_handler(tmp_path, keys_dir, peer):
    server, server_task = await start(TestHelperRecordingService, tmp_path, "server", keys_dir=str(keys_dir))
    client, client_task = await start(Service, tmp_path, "client", keys_dir=str(keys_dir))
    ours, other = load_keys(keys_dir), other_stack_keys(tmp_path, "other")
    credentials = {
        "no keys": {},
        "unknown client key": dict(public=other.client_public, secret=other.client_secret, server=ours.server_public),
        "wrong server key": dict(public=ours.client_public, secret=ours.client_secret, server=other.server_public),
    }[peer]
    # how the handshake fails, as the intruder's socket reports it first: a ZAP refusal says so; a
    # mechanism mismatch or a bad server key may read as NO_DETAIL (the server hangs up first)
    failures = {zmq.EVENT_HANDSHAKE_FAILED_AUTH} if peer == "unknown client key" else \
        {zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL}
    ctx = zmq.Context()
    intruder = bad_dealer(ctx, server.config.advertise, **credentials)
    monitor = intruder.get_monitor_socket(HANDSHAKE_EVENTS)
    try:
        intruder.connect(server.config.advertise)
        intruder.send_multipart(Codec("intruder").encode(Echo(b"intruder")))   # queued until a handshake succeeds
        event, value = await asyncio.to_thread(first_handshake_event, monitor)
        assert event in failures, (peer, zmq.Event(event), value)
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            assert value == 400   # the ZAP handler's "no access"
        # the legitimate peer's message goes after the refusal: the handler sees it, and only it
        reply = await client.call(server.config.advertise, Echo(b"legit"))
        assert reply.message.payload == b"legit"
        assert server.received == [b"legit"]
    finally:
        intruder.disable_monitor()
        monitor.close(0)
        intruder.close(0)
        ctx.term()
        await stop((client, client_task), (server, server_task))


async def test_a_plain_service_cannot_reach_a_curve_one(tmp_path, keys_dir):
    """A stack member started without keys_dir: its calls are never delivered (they time out)."""
    server, server_task = await start(TestHelperRecordingService, tmp_path, "server", keys_dir=str(keys_dir))
    plain, plain_task = await start(Service, tmp_path, "plain", call_timeout_s=0.5)
    client, client_task = await start(Service, tmp_path, "client", keys_dir=str(keys_dir))
    try:
        with pytest.raises(RequestTimeout):
            await plain.call(server.config.advertise, Echo(b"plain"))
        assert (await client.call(server.config.advertise, Echo(b"legit"))).message.payload == b"legit"
        assert server.received == [b"legit"]
    finally:
        await stop((client, client_task), (plain, plain_task), (server, server_task))


async def test_the_authenticator_thread_ends_with_the_service(tmp_path, keys_dir):
    before = len(auth_threads())
    svc, task = await start(Service, tmp_path, "svc", keys_dir=str(keys_dir))
    assert len(auth_threads()) == before + 1
    await stop((svc, task))
    assert len(auth_threads()) == before


def corrupt(keys_dir: Path, tmp_path: Path, how: str) -> tuple[Path, str]:
    """Break a keys dir one way; the path the error must name and a phrase it must hold."""
    if how == "no dir":
        return tmp_path / "absent", "not a directory"
    if how == "missing file":
        (keys_dir / "client.key").unlink()
        return keys_dir / "client.key", "missing"
    if how == "garbage":
        (keys_dir / "server.key_secret").write_text("not a certificate\n")
        return keys_dir / "server.key_secret", "not a readable ZeroMQ certificate"
    if how == "short key":
        (keys_dir / "server.key").write_text('curve\n    public-key = "tooshort"\n')
        return keys_dir / "server.key", "not a 40-character z85 CURVE key"
    if how == "pairs mixed":   # client.key of another stack: its secret is not this one's
        write_keys(tmp_path / "other")
        (keys_dir / "client.key").write_bytes((tmp_path / "other" / "client.key").read_bytes())
        return keys_dir / "client.key", "are not one key pair"
    raise ValueError(how)


@pytest.mark.parametrize("how", ["no dir", "missing file", "garbage", "short key", "pairs mixed"])
async def test_a_broken_keys_dir_fails_the_start_naming_the_file(tmp_path, keys_dir, how):
    path, phrase = corrupt(keys_dir, tmp_path, how)
    bad = keys_dir if how != "no dir" else path
    before = len(auth_threads())
    svc = Service(ServiceConfig(kind="echo", instance="svc", bind=f"ipc://{tmp_path}/svc.sock", keys_dir=str(bad)))
    assert await asyncio.wait_for(svc.run(install_signals=False), 10) == 1
    assert str(path) in svc.failure and phrase in svc.failure
    assert len(auth_threads()) == before
    with pytest.raises(KeysError):
        load_keys(bad)


def test_tools_load_keys_without_the_server_secret(keys_dir):
    (keys_dir / "server.key_secret").unlink()
    keys = load_keys(keys_dir, server=False)
    assert keys.server_secret is None and len(keys.client_secret) == 40
    assert keys.client_secret.decode() not in repr(keys)   # a secret never reaches a log line
    with pytest.raises(KeysError, match="server.key_secret"):
        load_keys(keys_dir)


def test_a_curve_server_socket_needs_an_authenticator_on_its_context(keys_dir):
    keys = load_keys(keys_dir)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        with pytest.raises(RuntimeError, match="authenticator"):   # else any client knowing server.key gets in
            curve.serve_curve(sock, keys)
        auth = curve.start_authenticator(ctx, keys)
        curve.serve_curve(sock, keys)
        assert sock.getsockopt(zmq.MECHANISM) == zmq.CURVE
        curve.stop_authenticator(auth)
    finally:
        sock.close(0)
        ctx.term()
