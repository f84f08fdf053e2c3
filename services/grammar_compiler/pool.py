"""CompilePool: compile jobs in child processes under a hard timeout.

llguidance cannot be interrupted once a grammar build starts (a pathological schema can hold a core
for minutes), and a thread cannot be killed; a process can. Each child (multiprocessing spawn: no
inherited event loop, sockets or threads) builds the tokenizer once (~1.5 s), then runs one job at a
time (check.compile_constraint). A job past `compile_timeout_s` gets its child SIGKILLed and
replaced, and its caller GrammarTimeout. Jobs wait in a bounded queue while every child is busy
(full: OVERLOADED). A child that dies otherwise fails its job with INTERNAL and is replaced.

Parent and child speak msgpack over a pipe (no pickle): child -> parent ["ready"] or
["failed", why] once, then per job ["ok", grammar, compile_ms] or ["error", code, message]. The
event loop reads the pipes (add_reader): no thread per child.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import msgspec

from messages.errors import (Draining, ErrorCode, GrammarTimeout, GrammarUnsupported, InvalidRequest,
                             Overloaded, WireError)
from services.runtime.parent_death import die_with_parent

START_TIMEOUT_S = 60.0                     # a child starts in ~2 s (most of it the tokenizer)
RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)   # after children that failed to start
_ERRORS = {ErrorCode.INVALID_REQUEST: InvalidRequest, ErrorCode.GRAMMAR_UNSUPPORTED: GrammarUnsupported,
           ErrorCode.GRAMMAR_TIMEOUT: GrammarTimeout}


class CompileCrashed(WireError):
    """INTERNAL: the child died while compiling (a library crash, or memory the constraint blew up)."""


@dataclass(slots=True, eq=False)
class _Job:
    constraint: str
    future: asyncio.Future


@dataclass(slots=True, eq=False)
class _Child:
    process: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection
    ready: asyncio.Future                  # set once the tokenizer is built (or the start failed)
    job: _Job | None = None
    timer: asyncio.TimerHandle | None = None   # the start deadline, then the running job's


@dataclass(slots=True)
class PoolStats:
    jobs: int = 0            # jobs handed to a child
    timeouts: int = 0        # children killed at the hard timeout
    crashes: int = 0         # children that died on their own
    restarts: int = 0        # children started to replace one
    start_failures: int = 0  # children that could not build their tokenizer


class CompilePool:
    def __init__(self, tokenizer_json: Path, processes: int = 2, compile_timeout_s: float = 10.0,
                 max_queue: int = 256, log=None):
        self.tokenizer_json = Path(tokenizer_json)
        self.processes = processes
        self.compile_timeout_s = compile_timeout_s
        self.max_queue = max_queue
        self.log = log
        self.stats = PoolStats()
        self._children: list[_Child] = []
        self._queue: deque[_Job] = deque()     # jobs waiting for a free child
        self._failures = 0                     # consecutive failed starts (back-off)
        self._start_error = ""                 # why the last start failed, while no child is ready
        self._restarting: asyncio.TimerHandle | None = None
        self._closed = False

    # ---- public ------------------------------------------------------------------------
    async def start(self) -> None:
        """Start every child; fails (and stops the ones started) if one cannot build its tokenizer."""
        for _ in range(self.processes):
            self._children.append(self._spawn())
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                await asyncio.gather(*(c.ready for c in self._children))
        except BaseException:
            await self.close()
            raise

    async def compile(self, constraint_json: str) -> tuple[str, float]:
        """(grammar text, compile ms) for one canonical constraint; raises the job's typed error."""
        if self._closed:
            raise Draining("the compile pool is closed")
        job = _Job(constraint_json, asyncio.get_running_loop().create_future())
        child = self._idle_child()
        if child is not None:
            self._run(child, job)
        elif self._start_error and not any(_ready(c) for c in self._children):
            raise WireError(f"no compile process is running: {self._start_error}")
        elif len(self._queue) >= self.max_queue:
            raise Overloaded(f"{len(self._queue)} compiles are waiting for a process (max_queue {self.max_queue})")
        else:
            self._queue.append(job)
        try:
            return await job.future
        except asyncio.CancelledError:
            if job in self._queue:   # nobody waits for it any more; a running job runs out (bounded)
                self._queue.remove(job)
            raise

    @property
    def busy(self) -> int:
        return sum(c.job is not None for c in self._children)

    @property
    def queued(self) -> int:
        return len(self._queue)

    def pids(self) -> list[int]:
        return [c.process.pid for c in self._children]

    async def close(self) -> None:
        """Kill every child and fail what waits. Idempotent."""
        self._closed = True
        if self._restarting is not None:
            self._restarting.cancel()
        for job in self._queue:
            _fail(job, Draining("the compile pool is closing"))
        self._queue.clear()
        children, self._children = self._children, []
        for child in children:
            self._retire(child, Draining("the compile pool is closing"))
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(None, c.process.join, 5.0) for c in children))

    # ---- children ----------------------------------------------------------------------
    def _spawn(self) -> _Child:
        context = multiprocessing.get_context("spawn")
        parent_end, child_end = context.Pipe(duplex=True)
        process = context.Process(target=child_main, args=(child_end, str(self.tokenizer_json), os.getpid()),
                                  name="grammar-compile", daemon=True)
        process.start()
        child_end.close()   # only the child holds it now: its death reads as EOF here
        loop = asyncio.get_running_loop()
        child = _Child(process, parent_end, loop.create_future())
        loop.add_reader(parent_end.fileno(), self._on_readable, child)
        # uvloop's add_reader makes the pipe non-blocking, but Connection's send/recv_bytes need a
        # blocking one: a message over the pipe's buffer (a schema or grammar of ~16 KB and up) would
        # be cut. The child answers at once (it writes only whole messages), so a blocking read is short.
        os.set_blocking(parent_end.fileno(), True)
        child.timer = loop.call_later(START_TIMEOUT_S, self._start_timed_out, child)
        return child

    def _idle_child(self) -> _Child | None:
        for child in self._children:
            if child.job is None and _ready(child):
                return child
        return None

    def _run(self, child: _Child, job: _Job) -> None:
        child.job = job
        self.stats.jobs += 1
        child.timer = asyncio.get_running_loop().call_later(self.compile_timeout_s, self._timed_out, child)
        try:
            child.conn.send_bytes(msgspec.msgpack.encode(job.constraint))
        except OSError:   # it died between jobs: the job waits for the replacement
            self._clear_job(child)
            self._queue.appendleft(job)
            self._lost(child, f"the compile process died ({_exit_of(child)})")

    def _on_readable(self, child: _Child) -> None:
        try:
            reply = msgspec.msgpack.decode(child.conn.recv_bytes())
        except (EOFError, OSError, msgspec.DecodeError):
            self._lost(child, f"the compile process died ({_exit_of(child)})")
            return
        if not child.ready.done():
            self._started(child, reply)
            return
        job = child.job
        self._clear_job(child)
        if job is not None:
            if reply[0] == "ok":
                if not job.future.done():
                    job.future.set_result((reply[1], reply[2]))
            else:
                _fail(job, _ERRORS.get(reply[1], WireError)(reply[2]))
        self._next(child)

    def _started(self, child: _Child, reply: list) -> None:
        self._cancel_timer(child)
        if reply[0] == "ready":
            self._failures, self._start_error = 0, ""
            child.ready.set_result(None)
            self._next(child)
            return
        self.stats.start_failures += 1
        self._start_failed(child, str(reply[1]) if len(reply) > 1 else "unknown")

    def _start_failed(self, child: _Child, why: str) -> None:
        self._start_error = why
        if not child.ready.done():
            child.ready.set_exception(RuntimeError(f"a compile process failed to start: {why}"))
            child.ready.exception()   # retrieved: start() or the restart path reports it
        self._retire(child, WireError(f"a compile process failed to start: {why}"))
        self._children.remove(child)
        if not any(_ready(c) for c in self._children):
            while self._queue:   # nothing can run them until a restart succeeds
                _fail(self._queue.popleft(), WireError(f"no compile process is running: {why}"))
        if self.log is not None:
            self.log.error("grammar_compiler.process_start_failed", error=why)
        self._schedule_restart()

    def _timed_out(self, child: _Child) -> None:
        self.stats.timeouts += 1
        if self.log is not None:
            self.log.warning("grammar_compiler.process_killed", pid=child.process.pid,
                             reason="compile_timeout", timeout_s=self.compile_timeout_s)
        self._replace(child, GrammarTimeout(f"compiling the constraint took longer than {self.compile_timeout_s:g} s"))

    def _start_timed_out(self, child: _Child) -> None:
        self.stats.start_failures += 1
        self._start_failed(child, f"no tokenizer after {START_TIMEOUT_S:g} s")

    def _lost(self, child: _Child, why: str) -> None:
        if child not in self._children:
            return
        if not child.ready.done():
            self.stats.start_failures += 1
            self._start_failed(child, why)
            return
        self.stats.crashes += 1
        if self.log is not None:
            self.log.error("grammar_compiler.process_died", pid=child.process.pid, error=why)
        self._replace(child, CompileCrashed(f"{why} while compiling the constraint"))

    def _replace(self, child: _Child, error: WireError) -> None:
        self._retire(child, error)
        self._children.remove(child)
        if not self._closed:
            self.stats.restarts += 1
            self._children.append(self._spawn())

    def _retire(self, child: _Child, error: WireError) -> None:
        """SIGKILL the child, stop watching its pipe, fail its job; the process is reaped later."""
        self._cancel_timer(child)
        job = child.job
        child.job = None
        try:
            asyncio.get_running_loop().remove_reader(child.conn.fileno())
        except (OSError, ValueError):
            pass
        child.conn.close()
        if child.process.exitcode is None:
            child.process.kill()
        _reap_later(child.process)
        if job is not None:
            _fail(job, error)

    def _schedule_restart(self) -> None:
        if self._closed or self._restarting is not None:
            return
        delay = RESTART_BACKOFF_S[min(self._failures, len(RESTART_BACKOFF_S) - 1)]
        self._failures += 1
        self._restarting = asyncio.get_running_loop().call_later(delay, self._restart)

    def _restart(self) -> None:
        self._restarting = None
        while not self._closed and len(self._children) < self.processes:
            self.stats.restarts += 1
            self._children.append(self._spawn())

    def _next(self, child: _Child) -> None:
        if self._queue and child.job is None:
            self._run(child, self._queue.popleft())

    def _clear_job(self, child: _Child) -> None:
        self._cancel_timer(child)
        child.job = None

    @staticmethod
    def _cancel_timer(child: _Child) -> None:
        if child.timer is not None:
            child.timer.cancel()
            child.timer = None


def _ready(child: _Child) -> bool:
    return child.ready.done() and child.ready.exception() is None


def _fail(job: _Job, error: WireError) -> None:
    if not job.future.done():
        job.future.set_exception(error)


def _exit_of(child: _Child) -> str:
    child.process.join(0.05)   # the pipe closed: it is exiting or gone
    code = child.process.exitcode
    if code is None:
        return "pipe closed"
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


def _reap_later(process) -> None:
    """Collect a killed child without blocking the event loop (SIGKILL takes effect at once)."""
    loop = asyncio.get_running_loop()
    loop.run_in_executor(None, process.join, 5.0)


# ---- the child process ---------------------------------------------------------------------
def child_main(conn, tokenizer_json: str, parent_pid: int) -> None:
    """One compile process: build the tokenizer, then answer jobs until the pipe closes."""
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the whole group: the parent decides
    from services.grammar_compiler.check import compile_constraint, load_tokenizer
    try:
        tokenizer = load_tokenizer(Path(tokenizer_json))
    except Exception as exc:   # noqa: BLE001 - say why to the parent, which fails its start
        conn.send_bytes(msgspec.msgpack.encode(["failed", f"{tokenizer_json}: {exc!r}"]))
        return
    conn.send_bytes(msgspec.msgpack.encode(["ready"]))
    while True:
        try:
            constraint = msgspec.msgpack.decode(conn.recv_bytes())
        except (EOFError, OSError):
            return
        try:
            grammar, compile_ms = compile_constraint(constraint, tokenizer)
            reply = ["ok", grammar, compile_ms]
        except WireError as exc:
            reply = ["error", int(exc.code), exc.message]
        except Exception as exc:   # noqa: BLE001 - a library bug on one constraint: report it, keep serving
            reply = ["error", int(ErrorCode.INTERNAL), f"compiling the constraint failed: {exc!r}"]
        conn.send_bytes(msgspec.msgpack.encode(reply))
