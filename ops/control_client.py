"""A small synchronous client for control messages (status, drain) used by the `epd` command.

Against a CURVE stack it is a CURVE client: `keys` defaults to the client keys of EPD_KEYS_DIR
(none set: plaintext). `why_no_answer` tells a refused handshake from a silent service.
"""
from __future__ import annotations

import time

import zmq

from messages import Codec, WireError
from messages.control import Drain, StatusQuery, StatusReply
from messages.errors import ErrorReply
from messages.registry import Message
from services.runtime.curve import KEYS_ENV, CurveKeys, connect_curve, keys_from_env


class _FromEnv:
    def __repr__(self) -> str:
        return f"FROM_ENV (the client keys of ${KEYS_ENV}, plaintext when unset)"


FROM_ENV = _FromEnv()   # the default of `keys`; else CurveKeys, or None for plaintext
Keys = CurveKeys | None | _FromEnv


def _keys(keys) -> CurveKeys | None:
    return keys_from_env() if keys is FROM_ENV else keys


def _dealer(ctx: zmq.Context, keys: CurveKeys | None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        connect_curve(sock, keys)
    return sock


def call(address: str, message: Message, timeout_s: float = 1.0, ctx: zmq.Context | None = None,
         keys: Keys = FROM_ENV):
    """Send one message and return the reply message, or None if nothing (valid) came back in time."""
    keys = _keys(keys)
    own = ctx is None
    ctx = ctx or zmq.Context()
    sock = _dealer(ctx, keys)
    codec = Codec(sender="epd-cli")
    try:
        sock.connect(address)
        sock.send_multipart(codec.encode(message))
        if not sock.poll(int(timeout_s * 1000)):
            return None
        try:
            reply = codec.decode(sock.recv_multipart()).message
        except WireError:
            return None
        return None if isinstance(reply, ErrorReply) else reply
    finally:
        sock.close(0)
        if own:
            ctx.term()


def query_status(address: str, timeout_s: float = 1.0, ctx: zmq.Context | None = None,
                 keys: Keys = FROM_ENV) -> StatusReply | None:
    reply = call(address, StatusQuery(), timeout_s, ctx, keys)
    return reply if isinstance(reply, StatusReply) else None


def request_drain(address: str, grace_s: float = -1.0, timeout_s: float = 1.0,
                  keys: Keys = FROM_ENV) -> StatusReply | None:
    reply = call(address, Drain(grace_s), timeout_s, keys=keys)
    return reply if isinstance(reply, StatusReply) else None


def why_no_answer(address: str, timeout_s: float = 1.0, keys: Keys = FROM_ENV) -> str:
    """Why `address` gives no status, in one line: a handshake it refused (CURVE on one side only,
    a client key it does not admit, another stack's server key), or silence."""
    from zmq.utils.monitor import recv_monitor_message
    keys = _keys(keys)
    ctx = zmq.Context()
    sock = _dealer(ctx, keys)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                      | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    codec = Codec(sender="epd-cli")
    try:
        sock.connect(address)
        sock.send_multipart(codec.encode(StatusQuery()))
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        hung_up = False   # a handshake the service ended without saying why (it may say on a retry)
        while (left_ms := int((deadline - time.monotonic()) * 1000)) > 0:
            ready = dict(poller.poll(left_ms))
            if sock in ready:
                return "it answers now"
            if monitor in ready:
                event = recv_monitor_message(monitor)
                if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                    hung_up = True
                    continue
                reason = _handshake_failure(event["event"], event["value"], keys)
                if reason:
                    return reason
        if hung_up:
            return _hung_up(keys)
        return f"no answer within {timeout_s:g}s (not running, or not reachable at this address)"
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
        ctx.term()


def _handshake_failure(event: int, value: int, keys: CurveKeys | None) -> str:
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        if keys is None:
            return f"handshake refused: the service uses CURVE and this client has no keys ({_SET_KEYS})"
        return f"handshake refused: the service does not use CURVE, this client does (keys {keys.directory})"
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (f"handshake refused: the service does not admit this client key "
                f"({keys.directory if keys else '?'}/client.key is not its stack's; ZAP status {value})")
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return f"handshake failed (protocol error {value:#x}); {_hung_up(keys)}"
    return ""


_SET_KEYS = f"set {KEYS_ENV} or pass --keys DIR"


def _hung_up(keys: CurveKeys | None) -> str:
    if keys is None:
        return f"the service ended the handshake: most likely it uses CURVE and this client has no keys ({_SET_KEYS})"
    return (f"the service ended the CURVE handshake: is {keys.directory}/server.key its stack's "
            f"(or does it not use CURVE)?")
