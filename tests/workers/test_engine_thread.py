"""EngineThread: commands run between steps; `after_step` runs on the engine thread right after a
step, before any queued command, and its result reaches the loop with the step's outputs."""
from __future__ import annotations

import asyncio
import threading

import pytest

from services.workers.engine_thread import EngineThread


class StepRecordingEngine:
    """Test-only engine: `pending` steps to run; each step returns its number as its output."""

    def __init__(self, steps: int):
        self.pending, self.events = steps, []
        self.in_step = threading.Event()
        self.step_may_finish = threading.Event()

    def has_unfinished(self) -> bool:
        return self.pending > 0

    def step(self) -> list:
        self.in_step.set()
        self.step_may_finish.wait(10)
        self.pending -= 1
        self.events.append(("step", threading.current_thread().name))
        return [self.pending]

    def request_ids(self):
        return []


async def test_after_step_runs_before_queued_commands_and_travels_with_the_outputs():
    loop = asyncio.get_running_loop()
    engine = StepRecordingEngine(steps=2)
    delivered, both = [], asyncio.Event()

    def on_outputs(outputs, extra):
        delivered.append((outputs, extra))
        if len(delivered) == 2:
            both.set()

    def after_step(eng, outputs):
        eng.events.append(("after", threading.current_thread().name))
        return f"after {outputs[0]}"

    thread = EngineThread(engine, on_outputs, lambda exc: None, loop, name="engine-test", after_step=after_step)
    thread.start()
    try:
        assert await loop.run_in_executor(None, engine.in_step.wait, 10)   # the first step is running
        command = asyncio.ensure_future(thread.call(lambda eng: eng.events.append(("command", "x"))))
        await asyncio.sleep(0)        # the command coroutine runs and queues itself
        engine.step_may_finish.set()
        await asyncio.wait_for(command, 10)
        await asyncio.wait_for(both.wait(), 10)
    finally:
        thread.stop()
    kinds = [kind for kind, _ in engine.events]
    # the first step's after_step ran before the command that was queued during that step
    assert kinds.index("after") < kinds.index("command")
    assert all(name == "engine-test" for kind, name in engine.events if kind != "command")
    assert delivered == [([1], "after 1"), ([0], "after 0")]


async def test_without_after_step_outputs_arrive_alone():
    loop = asyncio.get_running_loop()
    engine = StepRecordingEngine(steps=1)
    engine.step_may_finish.set()
    delivered = asyncio.Event()
    got = []

    def on_outputs(*args):
        got.append(args)
        delivered.set()

    thread = EngineThread(engine, on_outputs, lambda exc: None, loop)
    thread.start()
    try:
        await asyncio.wait_for(delivered.wait(), 10)
    finally:
        thread.stop()
    assert got == [([0],)]
