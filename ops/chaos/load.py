"""Load scenarios: a storm of concurrent requests (each completes or is refused as overload; memory
comes back), and clients that disconnect after the first chunk (every KV page comes back)."""
from __future__ import annotations

import asyncio
import json
import time

from ops.chaos.client import CHAT_PATH, MESSAGES_PATH, Flight, Result, chat_body, messages_body, request
from ops.chaos.runner import Context, prompt, stream_bodies
from ops.chaos.table import Row

STORM = 200                     # half Chat Completions, half Anthropic Messages
STORM_TOKENS = 16
WARMUP, WARMUP_WORDS = 32, 150  # the warm-up burst: > 2,048 prompt tokens (a full prefill batch) per worker
OVERLOAD_STATUS = {"chat": 429, "messages": 529}
RSS_NEAR_MIB = 64.0             # "back near baseline": within this, or within RSS_NEAR_SHARE of it
RSS_NEAR_SHARE = 0.15
SETTLE_S = 30.0                 # how long in-flight counts and memory may take to come back
DISCONNECTS = 20
WORKERS = ("prefill_worker", "decode_worker")


async def storm(ctx: Context) -> list[Row]:
    """200 requests at once. The RSS baseline is taken after a warm-up burst that fills every
    worker's batch once: a worker's first full batch grows its buffers for good, which is not
    what "back near baseline" is about."""
    row = Row("storm")
    ctx.progress(f"warm-up burst of {WARMUP} requests")
    warmup = await _burst(ctx, "storm-warmup", WARMUP, WARMUP_WORDS)
    row.check(all(r.completed for r in warmup), "the warm-up burst did not complete")
    baseline_rss = await asyncio.to_thread(ctx.stack.rss_mib)
    peak = dict(baseline_rss)
    sampling = asyncio.create_task(_sample_rss(ctx, peak))
    results = await _burst(ctx, "storm", STORM, 30)
    sampling.cancel()
    row.requests, row.completed = len(results), sum(r.completed for r in results)
    row.detail = [r.summary() for r in results]
    refused = [r for r in results if r.status == OVERLOAD_STATUS[r.protocol]]
    other = [r for r in results if not r.completed and r.status != OVERLOAD_STATUS[r.protocol]]
    row.errors += [f"{r.protocol}: {r.error or 'incomplete'}" for r in other]
    row.notes.append(f"{row.completed} completed, {len(refused)} refused as overload "
                     f"(429 chat / 529 messages), {len(other)} otherwise; by status "
                     f"{_by_status(results)}")
    row.check(not other, f"{len(other)} requests neither completed nor got 429/529")
    row.check(row.completed > 0, "no request completed")
    no_retry = sum(r.retry_after is None for r in refused)
    row.check(no_retry == 0, f"{no_retry} overload refusals carry no Retry-After")
    await _settled(ctx, row)
    after = await _rss_settled(ctx, baseline_rss)
    for instance in sorted(baseline_rss):
        row.notes.append(f"RSS MiB {instance:<18} baseline {baseline_rss[instance]:7.1f}  "
                         f"peak {peak.get(instance, 0):7.1f}  after {after.get(instance, 0):7.1f}")
    grown = [i for i in baseline_rss if i in after and not _near(baseline_rss[i], after[i])]
    row.check(not grown, f"RSS not back near baseline for {grown}")
    return [row]


async def _burst(ctx: Context, name: str, count: int, words: int) -> list[Result]:
    """`count` non-streamed requests at once, alternately Chat Completions and Messages."""
    calls = []
    async with ctx.http() as http:
        for i in range(count):
            protocol = "chat" if i % 2 == 0 else "messages"
            text = prompt(f"{ctx.salt}-{name}-{i}", words)
            body = (chat_body if protocol == "chat" else messages_body)(ctx.stack.model, text, STORM_TOKENS, False)
            path = CHAT_PATH if protocol == "chat" else MESSAGES_PATH
            calls.append(request(http, ctx.url(path), body, i, protocol))
        return list(await asyncio.gather(*calls))


def _by_status(results: list[Result]) -> dict:
    counts: dict[str, int] = {}
    for r in results:
        key = f"{r.protocol} {r.status or 'no answer'}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def _near(baseline: float, now: float) -> bool:
    return now <= baseline + max(RSS_NEAR_MIB, RSS_NEAR_SHARE * baseline)


async def _sample_rss(ctx: Context, peak: dict) -> None:
    while True:
        for instance, mib in (await asyncio.to_thread(ctx.stack.rss_mib)).items():
            peak[instance] = max(peak.get(instance, 0.0), mib)
        await asyncio.sleep(0.25)


async def _rss_settled(ctx: Context, baseline: dict) -> dict:
    """RSS once every service is back near its baseline, or as it is at the deadline."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        now = await asyncio.to_thread(ctx.stack.rss_mib)
        if time.monotonic() > deadline or all(_near(baseline[i], now[i]) for i in baseline if i in now):
            return now
        await asyncio.sleep(0.5)


async def _settled(ctx: Context, row: Row) -> None:
    """`epd status --json` until nothing is queued or in flight anywhere (checked, with a deadline)."""
    deadline, busy = time.monotonic() + SETTLE_S, {}
    started = time.monotonic()
    while time.monotonic() < deadline:
        status = await asyncio.to_thread(ctx.stack.epd, "status", "--json", "--run-dir", str(ctx.stack.run_dir),
                                         timeout_s=30.0)
        try:
            services = json.loads(status.stdout)["services"]
        except (ValueError, KeyError):
            services = []
        busy = {s["instance"]: (s["queue"], s["in_flight"]) for s in services if s["queue"] or s["in_flight"]}
        if services and not busy:
            row.notes.append(f"epd status: nothing queued or in flight {time.monotonic() - started:.1f} s after")
            return
        await asyncio.sleep(0.2)
    row.check(False, f"epd status still shows work {SETTLE_S:g} s after: (queue, in_flight) {busy}")


async def disconnect(ctx: Context) -> list[Row]:
    """20 streams, each client gone after its first chunk: every worker's kv_usage (pages in use)
    and every in-flight count return to what they were before."""
    row = Row("disconnect")
    before = await asyncio.to_thread(_worker_usage, ctx)
    peak: dict[str, float] = {}
    bodies = stream_bodies(ctx, "disconnect", count=DISCONNECTS, words=200, max_tokens=256)
    async with ctx.http() as http:
        flight = Flight(http, ctx.url(), bodies, stop_after_chunks=1)
        while flight.finished() < len(bodies):      # the pages the requests held while they ran
            for instance, seen in (await asyncio.to_thread(_worker_usage, ctx)).items():
                peak[instance] = max(peak.get(instance, 0.0), seen[0] if seen else 0.0)
            await asyncio.sleep(0.05)
        results = await flight.results()
    left = time.monotonic()
    row.requests = len(results)
    row.completed = sum(r.disconnected and bool(r.chunk_times) for r in results)
    row.stall_s = max(r.stall_s for r in results)
    row.errors += [r.error or "ended before its first chunk" for r in results if not r.disconnected]
    row.check(row.completed == row.requests, f"{row.requests - row.completed} streams never sent a first chunk")
    usage = before
    while time.monotonic() - left < SETTLE_S:
        usage = await asyncio.to_thread(_worker_usage, ctx)
        if _returned(before, usage):
            row.notes.append(f"every page returned {time.monotonic() - left:.2f} s after the last disconnect")
            break
        await asyncio.sleep(0.05)
    row.notes.append(f"(kv_usage, in_flight) per worker before {before}, after {usage}; "
                     f"highest kv_usage while they ran {peak}")
    row.check(any(peak.values()), "no worker ever showed pages in use: the check saw nothing to return")
    row.check(_returned(before, usage), f"pages or requests still held {SETTLE_S:g} s after the clients left")
    return [row]


def _worker_usage(ctx: Context) -> dict[str, tuple[float, int] | None]:
    """instance -> (kv_usage, in_flight) of every prefill and decode worker (None: no answer)."""
    out = {}
    for name in WORKERS:
        for instance, load in ctx.stack.loads(name).items():
            out[instance] = (round(load.kv_usage, 4), load.in_flight) if load else None
    return out


def _returned(before: dict, now: dict) -> bool:
    return all(now.get(i) is not None and b is not None and now[i][0] <= b[0] + 1e-9 and now[i][1] <= b[1]
               for i, b in before.items())
