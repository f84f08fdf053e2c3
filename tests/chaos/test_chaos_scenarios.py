"""`epd chaos` scenarios on a real stack (the default topology as processes, started as the command
starts it, one worker of each kind so it starts fast): disconnects, a port taken, the client's
deadline (which keeps every scenario from hanging on a stream that stops), and the faults: the decode
worker SIGKILLed (its streams resume on the restarted process, identical to a fault-free run), the
decode worker SIGSTOPped past the heartbeat limit (its streams move; when it wakes, its old attempts
are stopped and none of their tokens reach a client), the prefill router SIGKILLed and restarted."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from ops.chaos.client import Limits
from ops.chaos.runner import Context, send_all, stream_bodies
from ops.chaos import faults
from ops.chaos.scenarios import bind_fail, decode_freeze, decode_kill, disconnect, router_restart
from ops.chaos.stack import ChaosStack, send_cont

pytestmark = pytest.mark.slow
REPLICAS = 1        # one prefill and one decode worker: `epd chaos` runs two, but a test starts fast
# A row's numerics independent of its batch: with 129k random-weight logits a near-tie can flip a
# greedy token when a resume changes who shares a decode step (seen once in CI), which would say
# nothing about the fault handling these tests check.
BATCH_INVARIANT = {"batch_invariant": True}
STREAMS = 4         # concurrent streams per fault (`epd chaos` runs 8): the same paths, half the CPU time
# tokens per stream (`epd chaos` runs 96): a fault still lands after MID_STREAM_CHUNKS (4) text chunks
# with most of every stream still to come, at a third of the decode time of a batch-invariant CPU stack
STREAM_TOKENS = 32


@pytest.fixture(scope="module")
def ctx(tmp_path_factory, tiny_v41_model_dir):
    stack = ChaosStack.start(tmp_path_factory.mktemp("chaos"), tiny_v41_model_dir, REPLICAS, BATCH_INVARIANT)
    pids = [stack.state()["supervisor_pid"], *(s["pid"] for s in stack.services())]
    yield Context(stack, Limits(chunk_timeout_s=30.0, total_timeout_s=60.0), recover_s=30.0, quiet=True,
                  streams=STREAMS, stream_tokens=STREAM_TOKENS)
    down = stack.down()
    assert down.returncode == 0, down.stdout + down.stderr
    assert not [p for p in pids if _alive(p)], "epd down left a process of the chaos stack behind"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def test_disconnecting_clients_give_back_every_page(ctx):
    [row] = asyncio.run(disconnect(ctx))
    assert row.ok, row.failures + row.notes
    assert (row.requests, row.completed) == (20, 20)


def test_a_service_whose_port_is_taken_exits_and_the_supervisor_reports_it(ctx):
    restarts = ctx.stack.service("swa_registry-0")["restarts"]
    [row] = asyncio.run(bind_fail(ctx))
    assert row.ok, row.failures + row.notes
    assert ctx.stack.service("swa_registry-0")["restarts"] >= restarts + 2   # our kill, then the failed bind
    assert row.completed == 1                                              # serving again afterwards


def test_a_stream_that_stops_ends_at_the_client_deadline_with_an_error(ctx):
    """The gateway frozen: the request gets no answer; the client gives up at its deadline and
    says so, rather than hanging (what keeps a failing scenario from stalling `epd chaos`)."""
    gateway = ctx.stack.services("gateway")[0]["pid"]
    short = Context(ctx.stack, Limits(chunk_timeout_s=1.5, total_timeout_s=10.0), quiet=True)
    os.kill(gateway, signal.SIGSTOP)
    try:
        [result] = asyncio.run(send_all(short, stream_bodies(short, "frozen", count=1, max_tokens=4)))
    finally:
        send_cont(gateway)
    assert not result.completed and result.error.startswith("client deadline")
    assert 1.5 <= result.stall_s < 5.0
    assert ctx.stack.wait_healthy(30.0)


def _identical(row) -> None:
    assert row.ok, row.failures + row.notes
    assert not [n for n in row.notes if n.startswith("only ")], row.notes   # the fault came mid-stream
    assert row.requests == row.completed == STREAMS and row.identical == STREAMS, row


def test_a_killed_decode_workers_streams_resume_identical(ctx):
    [row] = asyncio.run(decode_kill(ctx))
    _identical(row)


def test_a_frozen_decode_workers_streams_move_and_its_old_attempts_are_stopped(ctx, monkeypatch):
    monkeypatch.setattr(faults, "FREEZE_S", 5.0)   # past the 3 s heartbeat limit, and a short test
    [row] = asyncio.run(decode_freeze(ctx))
    _identical(row)


def test_a_restarted_prefill_router_loses_no_request(ctx, monkeypatch):
    monkeypatch.setattr(faults, "ROUTERS", ("prefill_router",))
    [row] = asyncio.run(router_restart(ctx))
    _identical(row)
