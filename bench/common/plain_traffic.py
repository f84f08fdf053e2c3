"""The plain traffic of `epd bench grammar --ttft`: streaming chat requests arriving at a fixed
seeded rate, and their time to the first content token.

Each round's requests (seeded prompts of PROMPT_TOKENS, thinking off, greedy, a few tokens out;
bench/stack/workload.py builds the bodies) arrive at Poisson times of `rate` per second from the
window's start. Both sides of a round send the very same requests at the very same offsets, so
their TTFTs compare request by request; prompts stay under one 128-token KV block, so the second
copy of a request cannot be served from the block cache the first one filled (the usage's
cached_tokens says so).

TTFT is per request, from its send to the first SSE event that carries content text (what a client
sees first); a request that streams no text at all counts from its first event and is flagged.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

from bench.stack.sides import SseReading
from bench.stack.workload import BenchRequest

PROMPT_TOKENS = (16, 64)


@dataclass(frozen=True, slots=True)
class PlainRequest:
    round: int
    index: int
    offset_s: float            # arrival, from the window's start
    request: BenchRequest      # the HTTP body (and what the gateway's adapter makes of it)


@dataclass(slots=True)
class PlainOutcome:
    side: str
    round: int
    index: int
    late_s: float              # sent this long after its arrival time (the client falling behind)
    ttft_s: float              # send -> first content text (or first event, when no text came)
    first_event_s: float
    total_s: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    has_text: bool

    def row(self) -> dict:
        return {"side": self.side, "round": self.round, "index": self.index, "late_ms": _ms(self.late_s),
                "ttft_ms": _ms(self.ttft_s), "first_event_ms": _ms(self.first_event_s),
                "total_ms": _ms(self.total_s), "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "cached_tokens": self.cached_tokens,
                "has_text": self.has_text}


def split(total: int, rounds: int) -> list[int]:
    """`total` requests over `rounds` windows, as evenly as can be (the first ones take the rest)."""
    base, extra = divmod(total, rounds)
    return [base + (i < extra) for i in range(rounds)]


def arrivals(count: int, rate: float, rng: random.Random) -> list[float]:
    """Poisson arrival offsets at `rate` per second; the first at 0 (the window starts with a request)."""
    offsets, now = [], 0.0
    for i in range(count):
        if i:
            now += rng.expovariate(rate)
        offsets.append(now)
    return offsets


def plain_requests(workload, per_round: list[int], rate: float, max_tokens: int, seed: int,
                   label: str = "ttft") -> list[list[PlainRequest]]:
    """Every round's requests: prompt lengths, words and arrival times drawn from one seeded generator."""
    rng = random.Random(seed)
    rounds = []
    for round_, count in enumerate(per_round):
        offsets = arrivals(count, rate, rng)
        rounds.append([PlainRequest(round_, i, offsets[i],
                                    workload.request(label, round_, i, rng.randint(*PROMPT_TOKENS), max_tokens, rng))
                       for i in range(count)])
    return rounds


def run_window(url: str, side: str, requests: list[PlainRequest]) -> tuple[list[PlainOutcome], float]:
    """Send the window's requests at their arrival times; (outcomes, wall seconds)."""
    return asyncio.run(_window(f"{url}/v1/chat/completions", side, requests))


async def _window(url: str, side: str, requests: list[PlainRequest]) -> tuple[list[PlainOutcome], float]:
    import aiohttp
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        outcomes = await asyncio.gather(*(_one(session, url, side, r, start) for r in requests))
        return list(outcomes), time.perf_counter() - start


async def _one(session, url: str, side: str, plain: PlainRequest, start: float) -> PlainOutcome:
    delay = start + plain.offset_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)   # the arrival schedule, not a wait for anything
    request_id = f"{side}-{plain.round}-{plain.index}"
    reading = SseReading(request_id)
    sent = time.perf_counter()
    headers = {"Content-Type": "application/json", "x-request-id": request_id}
    async with session.post(url, data=plain.request.body, headers=headers) as reply:
        if reply.status != 200:
            raise RuntimeError(f"{request_id} answered {reply.status}: {(await reply.text())[:500]}")
        async for line in reply.content:
            if line.startswith(b"data: "):
                reading.feed(line, time.perf_counter() - sent)
    total = time.perf_counter() - sent
    if reading.first_event is None or not reading.usage:
        raise RuntimeError(f"{request_id} streamed no events or no usage")
    usage = reading.usage
    return PlainOutcome(side, plain.round, plain.index, sent - start - plain.offset_s,
                        reading.first_text if reading.first_text is not None else reading.first_event,
                        reading.first_event, total, usage["prompt_tokens"], usage["completion_tokens"],
                        (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                        reading.first_text is not None)


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)
