"""A small synchronous client for control messages (status, drain) used by the `epd` command."""
from __future__ import annotations

import zmq

from messages import Codec, WireError
from messages.control import Drain, StatusQuery, StatusReply
from messages.errors import ErrorReply
from messages.registry import Message


def call(address: str, message: Message, timeout_s: float = 1.0, ctx: zmq.Context | None = None):
    """Send one message and return the reply message, or None if nothing (valid) came back in time."""
    own = ctx is None
    ctx = ctx or zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
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


def query_status(address: str, timeout_s: float = 1.0, ctx: zmq.Context | None = None) -> StatusReply | None:
    reply = call(address, StatusQuery(), timeout_s, ctx)
    return reply if isinstance(reply, StatusReply) else None


def request_drain(address: str, grace_s: float = -1.0, timeout_s: float = 1.0) -> StatusReply | None:
    reply = call(address, Drain(grace_s), timeout_s)
    return reply if isinstance(reply, StatusReply) else None
