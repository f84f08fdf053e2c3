"""Scenarios that kill or freeze one process while greedy streams run through it, and compare every
stream with a fault-free run of the same requests on the same stack."""
from __future__ import annotations

import asyncio
import signal
import time

from ops.chaos.client import Flight
from ops.chaos.runner import (Context, busiest, check_streams, fill_row, mid_stream, recovered,
                              send_all, stream_bodies, wait_busy, watch_restart)
from ops.chaos.stack import send_cont
from ops.chaos.table import Row

STALL_LIMIT_S = 10.0            # the bound on a stream's longest silence across a fault
FREEZE_S = 10.0                 # SIGSTOP this long: longer than the heartbeat limit (3 s)
LONG_PROMPT_WORDS = 3000        # prefill_kill: ~3,000-token prompts
ROUTERS = ("prefill_router", "swa_registry", "decode_router")


async def _decode_fault(ctx: Context, row: Row, fault) -> None:
    """The shared shape of decode_kill and decode_freeze: 8 streams of the "decode" set, `fault`
    applied to the decode worker streaming most of them once all are mid-stream."""
    bodies = stream_bodies(ctx, "decode")
    baseline = await ctx.baseline("decode", bodies)
    async with ctx.http() as http:
        flight = Flight(http, ctx.url(), bodies)
        await mid_stream(ctx, row, flight)
        victim, seen = await asyncio.to_thread(busiest, ctx.stack, "decode_worker")
        row.notes.append(f"in flight per decode worker: {seen}; fault on {victim} at "
                         f"{time.monotonic() - flight.started_at:.1f} s")
        restart = await fault(victim)
        results = await flight.results()
    fill_row(row, results, baseline)
    tokens = [(b.completion_tokens, r.completion_tokens) for b, r in zip(baseline, results) if r.completed]
    row.check(all(b == r for b, r in tokens), f"completion tokens differ from the fault-free run: {tokens}")
    limit = STALL_LIMIT_S
    if restart is not None and len(ctx.stack.services("decode_worker")) == 1:
        # the only decode worker: its streams can resume nowhere before its restart, so the bound
        # counts from there (with two or more, as `epd chaos` runs, they move at once)
        took = await restart
        if took is not None:
            limit += took
            row.notes.append(f"the only decode worker: the stall limit is {STALL_LIMIT_S:g} s beyond its "
                             f"restart ({took:.1f} s)")
    check_streams(row, limit)
    await recovered(ctx, row, victim, restart)


async def decode_kill(ctx: Context) -> list[Row]:
    row = Row("decode_kill")

    async def kill(victim: str) -> asyncio.Task:
        pid = await asyncio.to_thread(ctx.stack.signal, victim, signal.SIGKILL)
        row.notes.append(f"SIGKILL {victim} (pid {pid})")
        return watch_restart(ctx, victim, pid)
    await _decode_fault(ctx, row, kill)
    return [row]


async def decode_freeze(ctx: Context) -> list[Row]:
    row = Row("decode_freeze")

    async def freeze(victim: str) -> None:   # nothing killed: no restart to wait for
        pid = await asyncio.to_thread(ctx.stack.signal, victim, signal.SIGSTOP)
        try:
            await asyncio.sleep(FREEZE_S)     # the fault itself: a process stopped this long
        finally:
            send_cont(pid)
        row.notes.append(f"SIGSTOP {victim} (pid {pid}) for {FREEZE_S:g} s, then SIGCONT")
    await _decode_fault(ctx, row, freeze)
    return [row]


async def prefill_kill(ctx: Context) -> list[Row]:
    """~3,000-token prompts; SIGKILL the prefill worker holding most of them during prefill.
    Two fault-free runs: one of other prompts of the same length first (how long an uncached
    prefill of this flight takes here: the stall limit is 10 s beyond it), and one of the same
    prompts after, for the outputs (run first, it would cache them and leave no prefill to cut)."""
    row = Row("prefill_kill")
    ctx.progress("fault-free run of other ~3,000-token prompts (the uncached prefill time)")
    reference = await send_all(ctx, stream_bodies(ctx, "prefill-reference", words=LONG_PROMPT_WORDS, max_tokens=32))
    reference_stall = max(r.stall_s for r in reference)
    bodies = stream_bodies(ctx, "prefill", words=LONG_PROMPT_WORDS, max_tokens=32)
    async with ctx.http() as http:
        flight = Flight(http, ctx.url(), bodies)
        # kill once every request reached a prefill worker (or 30 s passed): the busiest holds most
        busy = await wait_busy(ctx, "prefill_worker", 30.0, lambda load: load.in_flight,
                               lambda seen: sum(v or 0 for v in seen.values()) >= len(bodies))
        if busy is None:
            row.failures.append("no prefill worker reported work within 30 s; nothing killed")
            victim = restart = None
        else:
            victim, seen = busy
            pid = await asyncio.to_thread(ctx.stack.signal, victim, signal.SIGKILL)
            restart = watch_restart(ctx, victim, pid)
            row.notes.append(f"prefill jobs per worker: {seen}; SIGKILL {victim} (pid {pid}) at "
                             f"{time.monotonic() - flight.started_at:.1f} s, {flight.streaming()} streams started")
        results = await flight.results()
    if victim:
        await recovered(ctx, row, victim, restart)
    ctx.progress("fault-free run of the same 'prefill' requests (their outputs)")
    baseline = await send_all(ctx, bodies)
    fill_row(row, results, baseline)
    row.check(all(r.completed for r in reference), "the uncached fault-free run did not complete")
    row.notes.append(f"uncached fault-free run: longest stall {reference_stall:.1f} s (its prefill); "
                     f"the limit is {STALL_LIMIT_S:g} s beyond it")
    check_streams(row, STALL_LIMIT_S + reference_stall)
    return [row]


async def router_restart(ctx: Context) -> list[Row]:
    """SIGKILL the prefill router, the SWA registry and the decode router in turn, each while 8
    streams run; the supervisor restarts it; every stream completes, identical."""
    rows = []
    bodies = stream_bodies(ctx, "decode")
    baseline = await ctx.baseline("decode", bodies)
    for name in ROUTERS:
        row = Row(f"router_restart:{name}")
        started = time.monotonic()
        victim = ctx.stack.services(name)[0]["instance"]
        async with ctx.http() as http:
            flight = Flight(http, ctx.url(), bodies)
            await mid_stream(ctx, row, flight)
            pid = await asyncio.to_thread(ctx.stack.signal, victim, signal.SIGKILL)
            restart = watch_restart(ctx, victim, pid)
            row.notes.append(f"SIGKILL {victim} (pid {pid}) at {time.monotonic() - flight.started_at:.1f} s")
            results = await flight.results()
        fill_row(row, results, baseline)
        check_streams(row, STALL_LIMIT_S)
        if await recovered(ctx, row, victim, restart):
            after = await send_all(ctx, bodies[:1])
            row.check(after[0].completed, f"a request after the restart failed: {after[0].error}")
        row.seconds = time.monotonic() - started
        rows.append(row)
    return rows
