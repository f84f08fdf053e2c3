"""Service: the asyncio shell around a service's logic.

A subclass declares `handlers()` (message type -> async method) once; the shell owns the rest: sockets,
decoding, a bounded inbound queue, dispatch, replies, calls to peers (calls.py), membership of the peers
that register with it, its upstream link, lifecycle (STARTING -> RUNNING -> DRAINING -> STOPPED), summaries.

Dispatch: an accepted request starts at once while fewer than `concurrency` handlers run, else it
waits in the bounded backlog (`queue_size`; beyond it the sender gets OVERLOADED) and starts when a
handler ends. Every handler runs in a task of its own (so asyncio.timeout, TaskGroup and
current_task() behave as anywhere), in a copy of the receiving context. A draining service takes
control messages and `continuation_types` (parts of work it holds) only; an ErrorReply is never answered.

Handlers return None or a Message (sent back as the reply). A WireError raised by a handler
becomes an ErrorReply; any other exception becomes an INTERNAL ErrorReply and an error log.
"""
from __future__ import annotations

import asyncio
import contextvars
import os
import signal
import time
import traceback
from collections import deque
from typing import Awaitable, Callable

import structlog

from messages import Codec, Envelope, ErrorReply, Message, WireError
from messages.control import (Drain, Echo, EchoReply, Heartbeat, HeartbeatAck, Load, Register,
                              Registered, ServiceState, StatusQuery, StatusReply)
from messages.envelope import new_msg_id, random_hex
from messages.errors import Draining, ErrorCode, Overloaded, PeerDead, RequestTimeout, UnexpectedMessage
from services.runtime.calls import PendingCalls
from services.runtime.config import ServiceConfig
from services.runtime.context import Context
from services.runtime.logs import REQUEST_FIELDS
from services.runtime.membership import DispatchTracker, MembershipTable, Peer
from services.runtime.metrics import ServiceMetrics
from services.runtime.registration import register_peer, served_model_id
from services.runtime.tracing import SpanContext, span_from
from services.runtime.transport import CLOSE_LINGER_MS, Inbox, Link, Sockets
from services.runtime.upstream import UpstreamLink

Handler = Callable[[Message, Context], Awaitable[Message | None]]

# Handled at once, never queued and never refused while draining: they keep the mesh alive.
CONTROL_TYPES = (Register, Heartbeat, HeartbeatAck, Registered, StatusQuery, StatusReply, Drain)


class Service:
    kind = "echo"   # the base class alone is a complete diagnostic service: status, membership, echo
    streamed_types: tuple[type, ...] = ()   # parts of a request the subclass summarises itself: no line each
    continuation_types: tuple[type, ...] = ()   # parts of work already held (a stream's chunks): taken while draining
    model_id = ""   # the model identity this process serves (an engine worker sets it once loaded); "" = none

    def __init__(self, config: ServiceConfig):
        self.config = config
        self.codec = Codec(sender=config.instance)
        self.metrics = ServiceMetrics(self.kind, config.instance)
        self.log = structlog.get_logger().bind(service=self.kind, instance=config.instance)
        self.members = MembershipTable(config.dead_after_s)
        self.dispatched = DispatchTracker()
        self.state = ServiceState.STARTING
        self.started_at = time.time()
        self.incarnation = random_hex(64)   # this process, as StatusReply tells peers
        self.inbox: Inbox | None = None
        self.upstream: UpstreamLink | None = None
        self._handlers: dict[type, Handler] = {
            Register: self._on_register, Heartbeat: self._on_heartbeat, StatusQuery: self._on_status,
            Drain: self._on_drain, Echo: self._on_echo, **self.handlers()}
        self.sockets: Sockets | None = None
        self._calls = PendingCalls()
        self._backlog: deque[tuple[Context, contextvars.Context]] = deque()   # accepted, waiting for a free slot
        self._running = 0                          # request handlers running (<= config.concurrency)
        self._handler_tasks: set[asyncio.Task] = set()   # running handler tasks (cancelled at stop)
        self._background: set[asyncio.Task] = set()      # in_background() work (cancelled at stop)
        self._tasks: list[asyncio.Task] = []
        self._active = 0                           # accepted requests not yet finished (backlog + running)
        self._stopped: asyncio.Event | None = None
        self._drain_task: asyncio.Task | None = None
        self.failure = ""   # why the process exits non-zero: a failed start, or a task it cannot run without

    # ---- to override -------------------------------------------------------------------
    def handlers(self) -> dict[type, Handler]:
        return {}

    async def on_start(self) -> None:
        """Acquire resources (load a model, open a store) before the service reports RUNNING."""

    async def on_stop(self) -> None:
        """Release resources; called once, after in-flight work ended or the grace period ran out."""

    def in_flight(self) -> int:
        """Work this service still holds (a subclass adds streams it runs in the background)."""
        return self._active

    def load(self) -> Load:
        return Load(queue_depth=len(self._backlog), in_flight=self.in_flight())

    def on_upstream_lost(self) -> None:
        """Our upstream stopped answering (we reconnect with back-off); a subclass fails what it awaits."""

    def on_peer_dead(self, peer: Peer) -> None:
        """A registered peer stopped heartbeating: fail the work it held with PEER_DEAD."""
        for request_id, caller in self.dispatched.take_held_by(peer.instance):
            self.log.warning("request.peer_dead", request_id=request_id, peer=peer.instance)
            self._try_reply(caller, PeerDead(f"{peer.instance} died holding the request").to_reply())

    # ---- lifecycle ---------------------------------------------------------------------
    async def run(self, *, install_signals: bool = True) -> int:
        """Serve until stopped; returns the process exit code."""
        loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        if install_signals:
            loop.add_signal_handler(signal.SIGTERM, self.begin_drain)
            loop.add_signal_handler(signal.SIGINT, self.begin_drain)
        self.metrics.queue_depth.set_function(lambda: len(self._backlog))
        self.metrics.in_flight.set_function(self.in_flight)
        self.sockets = Sockets(self.config.hwm, lambda frames, link: self._accept(frames, link=link))
        try:
            self.sockets.secure_with(self.config.keys_dir)   # "" = plaintext; a bad dir fails here, naming the file
            self.inbox = self.sockets.bind(self.config.bind)
            await self.on_start()
        except Exception as exc:   # noqa: BLE001 - whatever failed, say why and exit at once
            self.failure = str(exc) or repr(exc)
            self.log.error("service.start_failed", error=self.failure, type=type(exc).__name__, bind=self.config.bind)
            await self._shutdown(release=self.inbox is not None)   # on_start ran once the inbox was bound
            return 1
        self.inbox.listen(lambda identity, frames: self._accept(frames, identity=identity))
        self._spawn(self._expire_peers())
        if self.config.upstream:
            self.upstream = UpstreamLink(self)
            self._spawn(self.upstream.run())
        if self.config.metrics_bind:
            from services.runtime.http import serve_metrics
            self._spawn(serve_metrics(self))
        self._set_state(ServiceState.RUNNING)
        self.log.info("service.ready", kind=self.kind, bind=self.inbox.bound, advertise=self.config.advertise, pid=os.getpid())
        await self._stopped.wait()
        await self._shutdown()
        return 1 if self.failure else 0

    def begin_drain(self, grace_s: float | None = None) -> None:
        """Stop taking work; stop once in-flight work is done or the grace period ends. Idempotent."""
        if self.state != ServiceState.RUNNING:
            if self.state == ServiceState.STARTING and self._stopped is not None:
                self._stopped.set()
            return
        grace = self.config.grace_s if grace_s is None or grace_s < 0 else grace_s
        self._set_state(ServiceState.DRAINING)
        self.log.info("service.draining", grace_s=grace, in_flight=self.in_flight())
        self._drain_task = asyncio.get_running_loop().create_task(self._drain(grace))

    def stop(self) -> None:
        """Stop now (idempotent); in-flight work is abandoned."""
        if self._stopped is not None:
            self._stopped.set()

    async def _drain(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (self.in_flight() or self._backlog):
            await asyncio.sleep(0.02)
        left = self.in_flight()
        self.log.info("service.drained" if not left else "service.grace_expired", abandoned=left)
        self.stop()

    async def _shutdown(self, release: bool = True) -> None:
        """Cancel what runs, on_stop() (if `release`), close the sockets; after a failed start too."""
        self._set_state(ServiceState.STOPPED)
        self._backlog.clear()
        tasks = [*self._tasks, *self._handler_tasks, *self._background]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._calls.close()
        try:
            if release:
                await self.on_stop()
        except Exception as exc:   # noqa: BLE001 - the sockets must close all the same, or term() hangs
            self.failure = self.failure or f"on_stop failed: {exc!r}"
            self.log.exception("service.stop_failed")
        self.sockets.close(0 if self.failure else CLOSE_LINGER_MS)
        self.log.info("service.stopped")

    def _set_state(self, state: ServiceState) -> None:
        self.state = state
        self.metrics.state.set(int(state))

    def _spawn(self, coro) -> asyncio.Task:
        """A task the service cannot serve without (upstream link, /metrics): if it fails, the process exits 1."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.append(task)
        task.add_done_callback(self._essential_task_done)
        return task

    def _essential_task_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None and not self.failure:
            self.failure = str(task.exception()) or repr(task.exception())
            self.log.error("service.task_failed", task=task.get_coro().__qualname__, error=self.failure)
            self.stop()

    def in_background(self, coro, failed_event: str, level: str = "error") -> asyncio.Task:
        """Run `coro` beside the handlers, unawaited; a failure is logged as `failed_event`; stop cancels it."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(lambda done: self._background_done(done, failed_event, level))
        return task

    def _background_done(self, task: asyncio.Task, failed_event: str, level: str) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            getattr(self.log, level)(failed_event, error=repr(task.exception()))

    # ---- sending -----------------------------------------------------------------------
    def link(self, address: str) -> Link:
        return self.sockets.link(address)

    def drop_link(self, address: str) -> None:
        """Close the link to a dead or abandoned peer at once (LINGER 0: drop what is queued)."""
        self.sockets.drop(address)
        self._calls.fail_to(address)   # calls to it will never be answered

    def send(self, address: str, message: Message, *, request_id: str = "", span: SpanContext | None = None,
             buffers=(), msg_id: str = "", in_reply_to: str = "") -> None:
        """One-way send; `in_reply_to` answers a call another service forwarded here (that caller's reply)."""
        frames = self.codec.encode(message, request_id=request_id, buffers=buffers, msg_id=msg_id,
                                   in_reply_to=in_reply_to, traceparent=span.traceparent if span else "")
        self.link(address).send(frames)
        self.metrics.sent(type(message).__name__)

    async def call(self, address: str, message: Message, *, request_id: str = "",
                   span: SpanContext | None = None, buffers=(), timeout: float | None = None) -> Envelope:
        """Send and wait for the reply; an ErrorReply is raised as RemoteError."""
        msg_id = new_msg_id()
        future = self._calls.open(msg_id, address, timeout or self.config.call_timeout_s)
        try:
            self.send(address, message, request_id=request_id, span=span, buffers=buffers, msg_id=msg_id)
            envelope = await future
        except asyncio.TimeoutError:
            raise RequestTimeout(f"{type(message).__name__} to {address} got no reply", request_id=request_id) from None
        finally:
            self._calls.forget(msg_id)
        if isinstance(envelope.message, ErrorReply):
            raise envelope.message.to_exception(request_id)
        return envelope

    # ---- receiving ---------------------------------------------------------------------
    def _accept(self, frames: list, *, identity: bytes | None = None, link: Link | None = None) -> None:
        try:
            envelope = self.codec.decode(frames)
        except WireError as exc:
            self.metrics.error(exc.code.name)
            self.log.warning("wire.rejected", code=exc.code.name, error=exc.message,
                             origin=identity.hex() if identity is not None else link.address)
            if identity is not None:   # answer on the inbox; never answer a reply (no error ping-pong)
                try:
                    self.inbox.send(identity, self.codec.encode(exc.to_reply(), request_id=exc.request_id))
                except WireError as undeliverable:
                    self.log.warning("reply.undeliverable", code=undeliverable.code.name)
            return
        header = envelope.header
        type_name = type(envelope.message).__name__
        self.metrics.received(type_name)
        if header.in_reply_to and self._calls.settle(header.in_reply_to, envelope):
            return
        ctx = Context(self, envelope, span_from(header.traceparent), identity=identity, link=link)
        handler = self._handlers.get(type(envelope.message))
        if handler is None:
            self._refuse(ctx, UnexpectedMessage(f"{self.kind} does not handle {type_name}"))
            return
        if isinstance(envelope.message, CONTROL_TYPES):
            self._start(self._handle(ctx, handler), contextvars.copy_context())
            return
        if self.state != ServiceState.RUNNING and not (
                self.state == ServiceState.DRAINING and isinstance(envelope.message, self.continuation_types)):
            self._refuse(ctx, Draining(f"{self.config.instance} is {ServiceState(self.state).name.lower()}"))
            return
        if self._running < self.config.concurrency:   # a free slot: the backlog is empty, start now
            self._running += 1
            self._active += 1   # counted from acceptance so a drain never misses queued work
            self._start(self._serve(ctx, handler), contextvars.copy_context())
        elif len(self._backlog) < self.config.queue_size:
            self._backlog.append((ctx, contextvars.copy_context()))
            self._active += 1
        else:
            self._refuse(ctx, Overloaded(f"{self.config.instance} inbound queue is full ({self.config.queue_size})"))

    def _refuse(self, ctx: Context, error: WireError) -> None:
        """Answer what this service will not take with a typed error, but never an error: two services
        refusing each other's errors would bounce them back and forth without end."""
        self.metrics.error(error.code.name)
        answered = not isinstance(ctx.message, ErrorReply)
        self.log.warning("message.refused", code=error.code.name, type=type(ctx.message).__name__,
                         answered=answered, request_id=ctx.request_id or None, sender=ctx.sender)
        if answered:
            self._try_reply(ctx, error.to_reply())

    def _start(self, coro, context: contextvars.Context) -> None:
        task = asyncio.get_running_loop().create_task(coro, context=context)
        self._handler_tasks.add(task)
        task.add_done_callback(self._handler_ended)

    def _handler_ended(self, task: asyncio.Task) -> None:
        self._handler_tasks.discard(task)
        if not task.cancelled():
            task.exception()   # retrieved: _handle already answered and logged what a handler raised

    async def _serve(self, ctx: Context, handler: Handler) -> None:
        """One accepted request in one of the `concurrency` slots; the slot then goes to the backlog."""
        try:
            await self._handle(ctx, handler, summarize=True)
        finally:
            self._active -= 1
            if self._backlog and self.state != ServiceState.STOPPED:   # the slot passes to the oldest waiting
                nxt, context = self._backlog.popleft()
                self._start(self._serve(nxt, self._handlers[type(nxt.message)]), context)
            else:
                self._running -= 1

    async def _handle(self, ctx: Context, handler: Handler, summarize: bool = False) -> None:
        header = ctx.envelope.header
        type_name = type(ctx.message).__name__
        started = time.time()
        outcome = "ok"
        fields = REQUEST_FIELDS.set(ctx)   # every log line of this handler carries ctx.log_fields()
        try:
            reply = await handler(ctx.message, ctx)
            if reply is not None:
                ctx.reply(reply)
        except WireError as exc:
            outcome = exc.code.name
            self.metrics.error(exc.code.name)
            self._try_reply(ctx, exc.to_reply())
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except Exception as exc:   # a bug in a handler: answer, log, keep serving
            outcome = ErrorCode.INTERNAL.name
            self.metrics.error(outcome)
            self.log.exception("handler.failed", type=type_name)
            self._try_reply(ctx, ErrorReply(int(ErrorCode.INTERNAL), f"{type_name}: {exc!r}"))
        finally:
            done = time.time()
            self.metrics.observe(type_name, done - started)
            if summarize and header.request_id and not isinstance(ctx.message, self.streamed_types):
                self.log.info("request.summary", type=type_name, sender=header.sender, start=started,
                              wire_ms=round((ctx.received_at - header.sent_at) * 1e3, 3),
                              queue_ms=round((started - ctx.received_at) * 1e3, 3),
                              handle_ms=round((done - started) * 1e3, 3), outcome=outcome)
            REQUEST_FIELDS.reset(fields)

    def _try_reply(self, ctx, reply: Message) -> None:
        if not isinstance(ctx, Context) or ctx.replied:
            return
        try:
            ctx.reply(reply)
        except WireError as exc:
            self.log.warning("reply.undeliverable", code=exc.code.name, request_id=ctx.request_id)

    # ---- built-in handlers -------------------------------------------------------------
    async def _on_register(self, msg: Register, ctx: Context) -> Registered:
        return register_peer(self, msg)   # registration.py: a worker of another model than its pool's is refused

    async def _on_heartbeat(self, msg: Heartbeat, ctx: Context) -> HeartbeatAck:
        known = self.members.heartbeat(msg.instance, msg.state, msg.load, time.monotonic())
        return HeartbeatAck(msg.seq, known, served_model_id(self))

    async def _on_status(self, msg: StatusQuery, ctx: Context) -> StatusReply:
        return StatusReply(
            kind=self.kind, instance=self.config.instance, state=int(self.state), pid=os.getpid(),
            uptime_s=round(time.time() - self.started_at, 3), load=self.load(),
            peers=self.members.status(time.monotonic()), upstream=self.config.upstream,
            upstream_connected=bool(self.upstream and self.upstream.connected), incarnation=self.incarnation,
            model_id=served_model_id(self))

    async def _on_drain(self, msg: Drain, ctx: Context) -> StatusReply:
        self.begin_drain(msg.grace_s)
        return await self._on_status(StatusQuery(), ctx)

    async def _on_echo(self, msg: Echo, ctx: Context) -> None:
        if msg.delay_ms > 0:
            await asyncio.sleep(msg.delay_ms / 1e3)
        env = ctx.envelope   # echo the buffers back as they came: no copy, same descriptors
        ctx.reply(EchoReply(msg.payload, self.config.instance), buffers=list(zip(env.header.tensors, env.buffers)))

    async def _expire_peers(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_s / 2)
            for peer in self.members.expire(time.monotonic()):
                try:
                    self.log.warning("peer.dead", peer=peer.instance, peer_kind=peer.kind, address=peer.address)
                    self.drop_link(peer.address)
                    self.on_peer_dead(peer)
                except Exception:   # noqa: BLE001 - one failing hook must not end dead-peer detection
                    try:
                        self.log.exception("peer.dead_hook_failed", peer=peer.instance)
                    except Exception:   # noqa: BLE001 - the log itself failed (a closed stream): stderr is left
                        traceback.print_exc()
            self.metrics.peers_alive.set(len(self.members.alive()))
