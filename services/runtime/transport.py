"""ZeroMQ sockets of one service: an Inbox (ROUTER, bound) and Links (DEALER, one per peer address).

Requests go to a peer's Inbox; replies come back on the Link that sent the request. Every socket
has finite high-water marks, and sends never block: a full queue raises Overloaded and an
unreachable peer raises PeerDead, so backpressure is visible to the caller.

The hot path drives plain (synchronous) zmq sockets from the running event loop rather than
zmq.asyncio, whose futures cost several libzmq calls (each a few syscalls) per message. A socket
is read either by one task awaiting `recv()`, or, cheaper, by a callback given to `listen()` that
the loop calls for every message as soon as the socket's FD wakes it (all queued messages in one
go, no future, no task switch). ZMQ_FD is edge-triggered: any call on the socket may consume the
notification, so after a send a waiting reader re-checks ZMQ_EVENTS, and a notification that no
reader waits for is consumed at once (the next `recv()` finds the message without waiting). A send
made while the listener of the same socket is delivering (a reply sent from inside the callback)
skips that re-check: the listener reads on until EAGAIN anyway. That re-check (a getsockopt) and
RCVMORE are a microsecond each in pyzmq, so frames are received as zmq.Frame and `more` is read
from the frame, and flags are plain ints (pyzmq's IntFlag `|` is a Python call).

Frames up to and including the header arrive as bytes (small: a copy is cheaper than a zmq.Frame
object); the buffer frames after it arrive as zero-copy zmq.Frame.

With CURVE keys (curve.py; `Sockets.secure`), the Inbox is a CURVE server admitting only the
stack's client key and every Link a CURVE client: libzmq encrypts each frame, the code here is
unchanged.
"""
from __future__ import annotations

import asyncio
import errno
from typing import Callable

import zmq

from messages.errors import Overloaded, PeerDead
from services.runtime.curve import (CurveKeys, connect_curve, load_keys, serve_curve, start_authenticator,
                                   stop_authenticator)

CLOSE_LINGER_MS = 500    # on orderly close: time for the last replies to leave
DRAIN_BATCH = 256        # messages one wake-up of a listener delivers before yielding to the loop

# Plain ints, not pyzmq's IntFlag members: `DONTWAIT | SNDMORE` on the enums is a Python-level call
# (about a microsecond) on every frame sent.
_DONTWAIT, _SNDMORE, _EVENTS, _POLLIN = int(zmq.DONTWAIT), int(zmq.SNDMORE), int(zmq.EVENTS), int(zmq.POLLIN)
_SEND_MORE = _DONTWAIT | _SNDMORE


def _received_frame(view: memoryview):
    """A view of a whole received zmq.Frame goes out as that Frame: libzmq shares the message by
    reference count, where any other zero-copy buffer pins a Python object through pyzmq's
    garbage-collector thread until libzmq is done with it."""
    owner = view.obj
    if type(owner) is zmq.Frame and view.c_contiguous and view.nbytes == len(owner):
        return owner
    return view


class _Endpoint:
    """One plain zmq socket on the running loop, read by one task (`_recv`) or one listener."""

    def __init__(self, ctx: zmq.Context, socket_type: int, hwm: int, copied_frames: int):
        self.sock = ctx.socket(socket_type, socket_class=zmq.Socket)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        self.sock.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
        self._copied = copied_frames   # leading frames received as bytes; the rest stay zero-copy
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = -1
        self._waiter: asyncio.Future | None = None            # the one pending recv()
        self._deliver: Callable[[list], None] | None = None   # the listener, once listen() was called
        self._drain_soon = False
        self._draining = False   # inside _drain: it reads on until EAGAIN, so sends skip the ZMQ_EVENTS re-check

    # ---- receiving ---------------------------------------------------------------------------
    def _recv_now(self) -> list:
        """One whole message without waiting, or zmq.Again. Frames are received as zmq.Frame, whose
        `more` is a field read (getsockopt(RCVMORE) costs about a microsecond per frame); the
        leading `copied` frames are handed on as bytes."""
        recv, copied = self.sock.recv, self._copied
        frame = recv(_DONTWAIT, False)
        frames = [frame.bytes]
        while frame.more:   # the rest of a multipart message is already here
            frame = recv(_DONTWAIT, False)
            frames.append(frame.bytes if len(frames) < copied else frame)
        return frames

    def _watch(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._fd = self.sock.FD
            self._loop.add_reader(self._fd, self._on_readable)

    async def _recv(self) -> list:
        if self._deliver is not None:
            raise RuntimeError("this socket has a listener; recv() would race it")
        try:
            return self._recv_now()
        except zmq.Again:
            pass
        if self._waiter is not None:
            raise RuntimeError("one receiver at a time per socket")
        self._watch()
        self._waiter = waiter = self._loop.create_future()
        try:
            return await waiter
        finally:
            if self._waiter is waiter:
                self._waiter = None

    def _listen(self, deliver: Callable[[list], None]) -> None:
        if self._waiter is not None or self._deliver is not None:
            raise RuntimeError("this socket already has a reader")
        self._deliver = deliver
        self._watch()
        self._schedule_drain()   # messages may have queued before we watched the FD

    def _on_readable(self) -> None:
        if self._deliver is not None:
            self._drain()
            return
        waiter = self._waiter
        if waiter is None or waiter.done():
            self.sock.getsockopt(_EVENTS)   # nobody waits: consume the notification, the next recv reads
            return
        try:
            frames = self._recv_now()
        except zmq.Again:
            return
        except zmq.ZMQError as exc:
            self._waiter = None
            waiter.set_exception(exc)
            return
        self._waiter = None
        waiter.set_result(frames)

    def _drain(self) -> None:
        """Deliver what is queued, up to DRAIN_BATCH messages; the rest on the next loop iteration."""
        self._drain_soon = False
        deliver = self._deliver
        self._draining = True
        try:
            for _ in range(DRAIN_BATCH):
                if self.sock.closed:
                    return
                try:
                    frames = self._recv_now()
                except zmq.Again:
                    return
                try:
                    deliver(frames)
                except Exception:   # the loop reports it; the messages behind it are still read
                    self._schedule_drain()
                    raise
            self._schedule_drain()
        finally:
            self._draining = False

    def _schedule_drain(self) -> None:
        if not self._drain_soon:
            self._drain_soon = True
            self._loop.call_soon(self._drain)

    # ---- sending -----------------------------------------------------------------------------
    def _send(self, frames: list, what: str) -> None:
        sock, last = self.sock, len(frames) - 1
        try:
            for i, frame in enumerate(frames):
                if type(frame) is memoryview:
                    frame = _received_frame(frame)
                sock.send(frame, _SEND_MORE if i < last else _DONTWAIT, copy=False)
        except zmq.Again:
            raise Overloaded(f"send queue to {what} is full (high-water mark)") from None
        except zmq.ZMQError as exc:
            if exc.errno == errno.EHOSTUNREACH:
                raise PeerDead(f"{what} is no longer connected") from None
            raise
        finally:   # the send may have consumed the FD's notification of a message a reader waits for
            # (not while this socket's _drain runs: it reads on until EAGAIN or schedules itself again)
            if (self._waiter is not None or self._deliver is not None) and not self._draining \
                    and not sock.closed and sock.getsockopt(_EVENTS) & _POLLIN:
                if self._deliver is not None:
                    self._schedule_drain()
                else:
                    self._on_readable()

    def close(self, linger_ms: int = CLOSE_LINGER_MS) -> None:
        if self.sock.closed:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(zmq.ZMQError(errno.ENOTSOCK))
        self.sock.close(linger=linger_ms)


class Inbox(_Endpoint):
    """The bound ROUTER socket: frames arrive as (identity, frames) and replies go back by identity."""

    def __init__(self, ctx: zmq.Context, bind: str, hwm: int, curve: CurveKeys | None = None):
        super().__init__(ctx, zmq.ROUTER, hwm, copied_frames=3)   # identity, tag, header
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)   # unroutable replies raise instead of vanishing
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)    # a reconnecting peer takes over its identity
        try:
            if curve is not None:
                serve_curve(self.sock, curve)
            self.sock.bind(bind)
        except zmq.ZMQError as exc:   # an open socket would block the context's term() forever
            self.sock.close(linger=0)
            raise OSError(exc.errno, f"cannot bind {bind}: {zmq.strerror(exc.errno).lower()}") from None
        except BaseException:
            self.sock.close(linger=0)
            raise
        self.bound = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    async def recv(self) -> tuple[bytes, list]:
        frames = await self._recv()
        return frames[0], frames[1:]

    def listen(self, on_message: Callable[[bytes, list], None]) -> None:
        """Call `on_message(identity, frames)` from the loop for every message, instead of recv()."""
        self._listen(lambda frames: on_message(frames[0], frames[1:]))

    def send(self, identity: bytes, frames: list) -> None:
        self._send([identity, *frames], f"peer {identity.hex()}")


class Link(_Endpoint):
    """A DEALER socket connected to one peer's Inbox."""

    def __init__(self, ctx: zmq.Context, address: str, hwm: int, curve: CurveKeys | None = None):
        super().__init__(ctx, zmq.DEALER, hwm, copied_frames=2)   # tag, header
        self.address = address
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        try:
            if curve is not None:
                connect_curve(self.sock, curve)
            self.sock.connect(address)
        except zmq.ZMQError as exc:   # as for a failed bind: close it, or term() waits on it forever
            self.sock.close(linger=0)
            raise OSError(exc.errno, f"cannot connect to {address}: {zmq.strerror(exc.errno).lower()}") from None
        except BaseException:
            self.sock.close(linger=0)
            raise

    async def recv(self) -> list:
        return await self._recv()

    def listen(self, on_message: Callable[[list], None]) -> None:
        """Call `on_message(frames)` from the loop for every message, instead of recv()."""
        self._listen(on_message)

    def send(self, frames: list) -> None:
        self._send(frames, self.address)


class Sockets:
    """Every ZeroMQ socket of one service, in one context: its Inbox, and a Link per peer address
    (opened on first use; `on_link_message(frames, link)` reads what comes back on it). After
    `secure(keys)` every one of them uses CURVE, and the context runs the ZAP authenticator."""

    def __init__(self, hwm: int, on_link_message: Callable[[list, Link], None]):
        self.ctx = zmq.Context()
        self.hwm = hwm
        self.inbox: Inbox | None = None
        self.links: dict[str, Link] = {}
        self._on_link_message = on_link_message
        self.curve: CurveKeys | None = None
        self._authenticator = None

    def secure(self, keys: CurveKeys) -> None:
        """CURVE on every socket from here on; before the first bind or link."""
        if self.inbox is not None or self.links:
            raise RuntimeError("secure() must come before any socket is opened")
        self._authenticator = start_authenticator(self.ctx, keys)
        self.curve = keys

    def secure_with(self, keys_dir: str) -> None:
        """`secure` with the keys in keys_dir (a KeysError names a missing or bad file); "" = plaintext."""
        if keys_dir:
            self.secure(load_keys(keys_dir))

    def bind(self, address: str) -> Inbox:
        self.inbox = Inbox(self.ctx, address, self.hwm, self.curve)
        return self.inbox

    def link(self, address: str) -> Link:
        link = self.links.get(address)
        if link is None:
            link = self.links[address] = Link(self.ctx, address, self.hwm, self.curve)
            link.listen(lambda frames: self._on_link_message(frames, link))
        return link

    def drop(self, address: str) -> None:
        """Close the link to `address` at once (LINGER 0: what is queued for it is dropped)."""
        link = self.links.pop(address, None)
        if link is not None:
            link.close(0)

    def close(self, inbox_linger_ms: int = CLOSE_LINGER_MS) -> None:
        """The links at once, the inbox once its last replies left, then the context. destroy() also
        closes any socket left open (a failed start's), which would block the context's term() forever."""
        for link in self.links.values():
            link.close(0)
        self.links.clear()
        if self.inbox is not None:
            self.inbox.close(inbox_linger_ms)
        if self._authenticator is not None:   # its thread uses sockets of this context: stop it first
            stop_authenticator(self._authenticator)
            self._authenticator = None
        self.ctx.destroy(linger=0)
