"""Runs an EngineCore on its own thread so model forwards never block the event loop.

The engine is not thread-safe: every call into it happens on the engine thread. The event loop
submits commands (add, abort, snapshot, ...) through a queue that the thread drains between
steps; step outputs come back to the loop through `call_soon_threadsafe`.

A command waits for the step in progress. Work that must follow a step at once (the prefill
worker's hand-off snapshot) goes in `after_step`, which runs on this thread right after each step
that produced outputs; its result travels to the loop with them: `on_outputs(outputs, result)`.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any, Callable

import structlog


class EngineThread:
    def __init__(self, engine, on_outputs: Callable[..., None], on_failure: Callable[[Exception], None],
                 loop: asyncio.AbstractEventLoop, name: str = "engine",
                 after_step: Callable[[Any, list], Any] | None = None):
        self.engine = engine
        self._on_outputs = on_outputs
        self._after_step = after_step
        self._on_failure = on_failure
        self._loop = loop
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.log = structlog.get_logger().bind(component="engine_thread")
        self.steps = 0
        self.last_error: str = ""

    def start(self) -> None:
        self._thread.start()

    async def call(self, fn: Callable[..., Any], *args) -> Any:
        """Run `fn(engine, *args)` on the engine thread between steps; return its result here."""
        future = self._loop.create_future()
        self._commands.put((fn, args, future))
        return await future

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            busy = self.engine.has_unfinished()
            self._drain_commands(block=not busy)
            if self._stop.is_set() or not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:   # a failed step must not kill the worker silently
                self.last_error = repr(exc)
                self.log.exception("engine.step_failed")
                self._abort_everything()
                self._loop.call_soon_threadsafe(self._on_failure, exc)
                continue
            self.steps += 1
            if outputs and self._after_step is not None:
                self._loop.call_soon_threadsafe(self._on_outputs, outputs, self._after_step(self.engine, outputs))
            elif outputs:
                self._loop.call_soon_threadsafe(self._on_outputs, outputs)

    def _drain_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, args, future = item
            try:
                result, error = fn(self.engine, *args), None
            except Exception as exc:
                result, error = None, exc
            self._loop.call_soon_threadsafe(_settle, future, result, error)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _abort_everything(self) -> None:
        """After a failed step no request's state can be trusted: free them all."""
        for request_id in list(self.engine.request_ids()):
            self.engine.abort(request_id)


def _settle(future: asyncio.Future, result, error) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
