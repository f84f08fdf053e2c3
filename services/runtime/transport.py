"""ZeroMQ sockets of one service: an Inbox (ROUTER, bound) and Links (DEALER, one per peer address).

Requests go to a peer's Inbox; replies come back on the Link that sent the request. Every socket
has finite high-water marks, and sends never block: a full queue raises Overloaded and an
unreachable peer raises PeerDead, so backpressure is visible to the caller.
"""
from __future__ import annotations

import errno

import zmq
import zmq.asyncio

from messages.errors import Overloaded, PeerDead

CLOSE_LINGER_MS = 500    # on orderly close: time for the last replies to leave


def _common(sock: zmq.Socket, hwm: int) -> None:
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)


def _send_now(sock: zmq.asyncio.Socket, frames: list, what: str) -> None:
    try:
        sock.send_multipart(frames, flags=zmq.DONTWAIT, copy=False).result()
    except zmq.Again:
        raise Overloaded(f"send queue to {what} is full (high-water mark)") from None
    except zmq.ZMQError as exc:
        if exc.errno == errno.EHOSTUNREACH:
            raise PeerDead(f"{what} is no longer connected") from None
        raise


class Inbox:
    """The bound ROUTER socket: frames arrive as (identity, frames) and replies go back by identity."""

    def __init__(self, ctx: zmq.asyncio.Context, bind: str, hwm: int):
        self.sock = ctx.socket(zmq.ROUTER)
        _common(self.sock, hwm)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)   # unroutable replies raise instead of vanishing
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)    # a reconnecting peer takes over its identity
        self.sock.bind(bind)
        self.bound = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    async def recv(self) -> tuple[bytes, list]:
        frames = await self.sock.recv_multipart(copy=False)
        return frames[0].bytes, frames[1:]

    def send(self, identity: bytes, frames: list) -> None:
        _send_now(self.sock, [identity, *frames], f"peer {identity.hex()}")

    def close(self, linger_ms: int = CLOSE_LINGER_MS) -> None:
        self.sock.close(linger=linger_ms)


class Link:
    """A DEALER socket connected to one peer's Inbox."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, hwm: int):
        self.address = address
        self.sock = ctx.socket(zmq.DEALER)
        _common(self.sock, hwm)
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        self.sock.connect(address)

    async def recv(self) -> list:
        return await self.sock.recv_multipart(copy=False)

    def send(self, frames: list) -> None:
        _send_now(self.sock, frames, self.address)

    def close(self, linger_ms: int = CLOSE_LINGER_MS) -> None:
        self.sock.close(linger=linger_ms)
