"""kv_writer_kill: SIGKILL the KV writer while the blocks of a shared prefix are being written;
after the supervisor restarts it, the same requests return the same greedy output and report
cached tokens."""
from __future__ import annotations

import asyncio
import signal
import time

from ops.chaos.client import Flight
from ops.chaos.runner import (Context, check_streams, fill_row, recovered, send_all, stream_bodies,
                              watch_restart)
from ops.chaos.table import Row

PREFIX_WORDS = 1200             # ~9 blocks of 128 tokens shared by every request
REQUESTS = 4


async def kv_writer_kill(ctx: Context) -> list[Row]:
    row = Row("kv_writer_kill")
    bodies = stream_bodies(ctx, "kv", count=REQUESTS, words=20, max_tokens=64, prefix_words=PREFIX_WORDS)
    victim = ctx.stack.services("kv_writer")[0]["instance"]
    async with ctx.http() as http:
        # the prefix is new: its blocks are written while the first requests stream
        flight = Flight(http, ctx.url(), bodies)
        if not await flight.wait_for(lambda: flight.streaming() >= 1, 60.0):
            row.notes.append("no stream had started when the KV writer was killed")
        pid = await asyncio.to_thread(ctx.stack.signal, victim, signal.SIGKILL)
        restart = watch_restart(ctx, victim, pid)
        row.notes.append(f"SIGKILL {victim} (pid {pid}) at {time.monotonic() - flight.started_at:.1f} s, "
                         f"{flight.streaming()} of {len(bodies)} streaming")
        before = await flight.results()
    fill_row(row, before, None)
    if await recovered(ctx, row, victim, restart):
        ctx.progress("the same requests after the KV writer's restart")
        after = await send_all(ctx, bodies)
        fill_row(row, after, before)          # identical: after vs before
        cached = [r.cached_tokens for r in after]
        row.notes.append(f"cached tokens after the restart: {cached} (prompt tokens "
                         f"{[r.prompt_tokens for r in after]})")
        row.check(all((c or 0) > 0 for c in cached), f"requests sharing the prefix reported no cached tokens: {cached}")
    check_streams(row)
    return [row]
