"""pool.py with real compile processes: the hard timeout kills and replaces a child, a child that
dies mid-compile fails its job and is replaced, the queue is bounded, a bad tokenizer fails the start."""
from __future__ import annotations

import asyncio
import os
import signal
import time
from contextlib import asynccontextmanager

import pytest

from messages.errors import ErrorCode, GrammarTimeout, Overloaded
from messages.grammar import constraint_json
from services.grammar_compiler.pool import CompileCrashed, CompilePool
from tests.grammar_compiler.test_helper_constraints import SIMPLE_SCHEMA, SLOW_SCHEMA, json_schema, tokenizer_json
from tests.helpers.test_helper_async import eventually

pytestmark = pytest.mark.slow   # starts compile processes (~2 s each: the tokenizer)


@asynccontextmanager
async def started_pool(**settings):
    pool = CompilePool(tokenizer_json(), **{"processes": 1, **settings})
    await pool.start()
    try:
        yield pool
    finally:
        await pool.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_a_child_past_the_timeout_or_dead_is_replaced_and_its_job_fails_typed():
    """One pool (starting children is the slow part): the hard timeout, the queue bound, queued work
    moving to the replacement; then a child killed mid-compile."""
    async with started_pool(compile_timeout_s=1.0, max_queue=1) as pool:
        [first_pid] = pool.pids()
        started = time.monotonic()
        slow = asyncio.ensure_future(pool.compile(json_schema(SLOW_SCHEMA)))
        queued = asyncio.ensure_future(pool.compile(json_schema(SIMPLE_SCHEMA)))
        await eventually(lambda: pool.busy == 1 and pool.queued == 1, what="one running, one queued")
        with pytest.raises(Overloaded, match="max_queue 1"):
            await pool.compile(constraint_json({"kind": "json_object"}))
        with pytest.raises(GrammarTimeout, match="^compiling the constraint took longer than 1 s$"):
            await slow
        assert 1.0 <= time.monotonic() - started < 5.0   # the compile itself takes ~30 s
        grammar, compile_ms = await queued   # ran on the replacement
        assert '"age":{"type":"integer"}' in grammar and compile_ms > 0
        [second_pid] = pool.pids()
        assert second_pid != first_pid
        await eventually(lambda: not alive(first_pid), what="the timed-out child killed and reaped")
        assert (pool.stats.timeouts, pool.stats.restarts, pool.stats.crashes) == (1, 1, 0)

        pool.compile_timeout_s = 60.0   # now the child dies first
        slow = asyncio.ensure_future(pool.compile(json_schema(SLOW_SCHEMA)))
        await eventually(lambda: pool.busy == 1, what="the slow compile running")
        os.kill(second_pid, signal.SIGKILL)
        with pytest.raises(CompileCrashed, match="the compile process died .* while compiling") as died:
            await slow
        assert died.value.code == ErrorCode.INTERNAL
        grammar, _ = await pool.compile(constraint_json({"kind": "json_object"}))   # waits for the replacement
        assert '"type":"object"' in grammar
        assert second_pid not in pool.pids() and (pool.stats.crashes, pool.stats.restarts) == (1, 2)


async def test_a_tokenizer_that_does_not_load_fails_the_start_with_the_reason(tmp_path):
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{}")
    pool = CompilePool(broken, processes=1)
    with pytest.raises(RuntimeError, match=f"a compile process failed to start: {broken}"):
        await pool.start()
    assert pool.pids() == []


def test_large_constraints_and_grammars_cross_the_pipe_whole_under_uvloop():
    """The services run on uvloop, whose add_reader makes the pipe non-blocking: a constraint and
    a grammar far over the pipe's buffer (here ~150 KB each way) must still arrive whole."""
    import uvloop
    schema = {"type": "object", "properties": {f"field_{i:05d}": {"type": "integer"} for i in range(6000)},
              "required": [f"field_{i:05d}" for i in range(6000)]}

    async def compile_big():
        async with started_pool(compile_timeout_s=60.0) as pool:
            pids = pool.pids()
            result = await pool.compile(constraint_json({"kind": "json_schema", "schema": schema, "strict": True}))
            return result, pool.stats, pids == pool.pids()

    (grammar, ms), stats, same_child = uvloop.run(compile_big())
    assert len(grammar) > 100_000 and "field_05999" in grammar and ms > 0
    assert same_child and stats.jobs == 1 and stats.crashes == stats.restarts == 0   # no cut message, no retry
