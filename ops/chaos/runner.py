"""What every scenario shares: the Context (stack, limits, fault-free runs), the prompts, and the
steps they are built of (send a flight, wait for it to be mid-stream, find the busiest worker,
fill a Row from the results)."""
from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import dataclass, field

from ops.chaos.client import CHAT_PATH, Flight, Limits, Result, chat_body, session
from ops.chaos.stack import ChaosStack
from ops.chaos.table import Row, count_identical

# Common English words, about one token each with their leading space: a prompt of N words is
# close to N tokens. Seeded per request so no two prompts share a 128-token block by accident.
WORDS = ("time person year way day thing man world life hand part child eye woman place work week "
         "case point number group problem fact say get make know take see come think look want give use "
         "find tell ask seem feel try leave call good new first last long great little own other old "
         "right big high different small large next early young important few public bad same able "
         "river stone light market paper music table window garden letter").split()
STREAMS = 8                     # concurrent greedy streams of the kill and freeze scenarios
STREAM_TOKENS = 96              # long enough that a fault lands mid-stream on a CPU stack
MID_STREAM_CHUNKS = 4           # text chunks every stream has seen before the fault


@dataclass
class Context:
    stack: ChaosStack
    limits: Limits = field(default_factory=Limits)
    salt: str = field(default_factory=lambda: str(time.time_ns()))   # fresh prompts on a reused stack
    recover_s: float = 90.0     # how long a killed service may take to be back
    streams: int = STREAMS      # concurrent streams of the kill, freeze and restart scenarios
    stream_tokens: int = STREAM_TOKENS   # tokens per stream of those scenarios (tests run shorter ones)
    baselines: dict[str, list[Result]] = field(default_factory=dict)
    quiet: bool = False

    def url(self, path: str = CHAT_PATH) -> str:
        return self.stack.url + path

    def http(self):
        return session(self.limits)

    def progress(self, what: str) -> None:
        if not self.quiet:
            print(f"epd chaos: [{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)

    async def baseline(self, key: str, bodies: list[dict]) -> list[Result]:
        """The fault-free run of these requests on this stack (once per key)."""
        if key not in self.baselines:
            self.progress(f"fault-free run of the {key!r} requests")
            self.baselines[key] = await send_all(self, bodies)
        return self.baselines[key]


def prompt(seed: str, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def stream_bodies(ctx: Context, name: str, count: int = 0, words: int = 60,
                  max_tokens: int = 0, prefix_words: int = 0) -> list[dict]:
    """`count` (default ctx.streams) greedy streaming chat bodies of `max_tokens` (default
    ctx.stream_tokens); with prefix_words they share a prefix of that length."""
    count = count or ctx.streams
    max_tokens = max_tokens or ctx.stream_tokens
    prefix = prompt(f"{ctx.salt}-{name}-prefix", prefix_words) + " " if prefix_words else ""
    return [chat_body(ctx.stack.model, prefix + prompt(f"{ctx.salt}-{name}-{i}", words), max_tokens)
            for i in range(count)]


async def send_all(ctx: Context, bodies: list[dict]) -> list[Result]:
    async with ctx.http() as http:
        return await Flight(http, ctx.url(), bodies).results()


async def mid_stream(ctx: Context, row: Row, flight: Flight, chunks: int = MID_STREAM_CHUNKS,
                     timeout_s: float = 60.0) -> None:
    """Wait until every request of the flight has streamed `chunks` text chunks (noted if not)."""
    everyone = len(flight.tasks)
    if not await flight.wait_for(lambda: flight.streaming(chunks) == everyone, timeout_s):
        row.notes.append(f"only {flight.streaming(chunks)} of {everyone} streams had {chunks} chunks "
                         f"when the fault came ({flight.finished()} already ended)")


def busiest(stack: ChaosStack, name: str, measure=lambda load: load.in_flight) -> tuple[str, dict]:
    """The replica of service `name` with the most work now, and every replica's measure."""
    loads = stack.loads(name)
    seen = {instance: (measure(load) if load else None) for instance, load in loads.items()}
    victim = max(seen, key=lambda i: -1 if seen[i] is None else seen[i])
    return victim, seen


async def wait_busy(ctx: Context, name: str, timeout_s: float, measure, enough) -> tuple[str, dict] | None:
    """Poll the replicas of `name` until enough(seen) holds for seen = {instance: measure(load)};
    then (the busiest, seen). At the deadline: the same if any replica had work, else None."""
    deadline = time.monotonic() + timeout_s
    while True:
        victim, seen = await asyncio.to_thread(busiest, ctx.stack, name, measure)
        if enough(seen):
            return victim, seen
        if time.monotonic() > deadline:
            return (victim, seen) if (seen[victim] or 0) > 0 else None
        await asyncio.sleep(0.05)


def fill_row(row: Row, results: list[Result], baseline: list[Result] | None) -> None:
    """requests, completed, identical (to the baseline's text), stall and errors from the results."""
    row.requests += len(results)
    row.completed += sum(r.completed for r in results)
    row.stall_s = max([row.stall_s or 0.0, *(r.stall_s for r in results)])
    row.errors += [r.error or f"incomplete (HTTP {r.status}, no terminal event)" for r in results if not r.completed]
    row.detail += [r.summary() for r in results]
    if baseline is not None:
        same, differences = count_identical([b.text for b in baseline], [r.text for r in results])
        row.identical = (row.identical or 0) + same
        row.compared = (row.compared or 0) + len(results)
        row.notes += differences[:8]
        baseline_done = sum(b.completed for b in baseline)
        row.check(baseline_done == len(baseline),
                  f"the fault-free run itself completed only {baseline_done} of {len(baseline)}")


def check_streams(row: Row, stall_limit_s: float | None = None) -> None:
    """The verdict on a row's streams: all complete, all identical, stall within the limit."""
    row.check(row.completed == row.requests, f"{row.requests - row.completed} of {row.requests} did not complete")
    if row.identical is not None:
        row.check(row.identical == row.compared,
                  f"{row.compared - row.identical} of {row.compared} differ from the fault-free run")
    if stall_limit_s is not None and row.stall_s is not None:
        row.check(row.stall_s < stall_limit_s, f"longest stall {row.stall_s:.1f} s >= {stall_limit_s:g} s")


def watch_restart(ctx: Context, instance: str, killed_pid: int) -> asyncio.Task:
    """Time the supervisor's restart of an instance killed just now, beside the scenario's flight:
    a task giving the seconds until its new process runs (None past ctx.recover_s)."""
    return asyncio.ensure_future(asyncio.to_thread(ctx.stack.wait_restarted, instance, killed_pid, ctx.recover_s))


async def recovered(ctx: Context, row: Row, instance: str, restart: asyncio.Task | None) -> bool:
    """Wait for the restart `watch_restart` watches (if any), then for a healthy stack; checked."""
    if restart is not None:
        took = await restart
        if not row.check(took is not None, f"{instance} was not running again {ctx.recover_s:g} s after the kill"):
            return False
        row.notes.append(f"{instance} running again {took:.1f} s after the kill")
    healthy = await asyncio.to_thread(ctx.stack.wait_healthy, ctx.recover_s)
    return row.check(healthy, f"the stack was not healthy {ctx.recover_s:g} s after the fault "
                              f"(not ready: {ctx.stack.not_ready()})")
