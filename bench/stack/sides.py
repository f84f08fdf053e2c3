"""The two sides of `epd bench stack`, one round (a set of concurrent requests) at a time.

  stack   every request of the round POSTed at once to the gateway's /v1/chat/completions (aiohttp,
          streaming). TTFT = the response's first SSE event: the gateway writes the response head
          and its first event when the first token reaches it (even if the detokenizer holds that
          token's text back); the first event with text is recorded beside it.
  engine  an EngineCore in this process with the workers' settings, loaded and stepped on a thread
          of its own as a worker steps its engine (EngineThread): the round's requests added at
          once, stepped until done. TTFT = the step that returns the request's first token.
Both measure from the moment the round starts; a round's wall time ends with its last token. CPU
time per round: the stack's service processes (/proc/<pid>/stat), or this process for the engine.
"""
from __future__ import annotations

import asyncio
import json
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from bench.stack.workload import BenchRequest


@dataclass(slots=True)
class Outcome:
    """One request on one side."""
    round: int
    stream: int
    prompt_tokens: int
    ttft_s: float
    total_s: float
    completion_tokens: int
    cached_tokens: int
    finish_reason: str
    text: str
    first_text_s: float | None = None          # stack only: first event that carries text

    def row(self, side: str) -> dict:
        return {"side": side, "round": self.round, "stream": self.stream, "prompt_tokens": self.prompt_tokens,
                "ttft_ms": round(self.ttft_s * 1e3, 3), "total_ms": round(self.total_s * 1e3, 3),
                "first_text_ms": None if self.first_text_s is None else round(self.first_text_s * 1e3, 3),
                "completion_tokens": self.completion_tokens, "cached_tokens": self.cached_tokens,
                "finish_reason": self.finish_reason}


@dataclass(slots=True)
class Round:
    side: str
    index: int
    wall_s: float
    outcomes: list[Outcome]
    cpu_s: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(o.completion_tokens for o in self.outcomes)


# ---- the engine alone ---------------------------------------------------------------------------
class EngineSide:
    def __init__(self, engine_settings: dict) -> None:
        from engine.engine_core import EngineConfig, EngineCore
        self.thread = OwnThread("bench-engine")
        self.engine = self.thread.call(EngineCore, EngineConfig(**engine_settings))

    def run_round(self, index: int, requests: list[BenchRequest]) -> Round:
        cpu = time.process_time()
        result = self.thread.call(self._round, index, requests)
        result.cpu_s = time.process_time() - cpu
        return result

    def _round(self, index: int, requests: list[BenchRequest]) -> Round:
        from engine.engine_core import EngineRequest
        start = time.perf_counter()
        for request in requests:
            self.engine.add_request(EngineRequest(request.request_id, list(request.prompt_ids),
                                                  request.prepared.sampling, arrival_time=time.time()))
        tokens, first, done = self._step_until_done(start)
        wall = time.perf_counter() - start
        missing = [r.request_id for r in requests if r.request_id not in done]
        if missing:
            raise RuntimeError(f"engine: requests {missing} never finished")
        return Round("engine", index, wall, [_engine_outcome(r, tokens.get(r.request_id, []), first.get(r.request_id),
                                                             *done[r.request_id]) for r in requests])

    def _step_until_done(self, start: float):
        """Step until the engine is idle: each request's tokens, first-token time, (end, finish, cached)."""
        tokens: dict[str, list[int]] = {}
        first: dict[str, float] = {}
        done: dict[str, tuple] = {}
        while self.engine.has_unfinished():
            outputs = self.engine.step()
            now = time.perf_counter() - start
            for out in outputs:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.new_token_ids:
                    first.setdefault(out.request_id, now)
                if out.finish_reason is not None:
                    done[out.request_id] = (now, out.finish_reason, out.num_cached_tokens)
        return tokens, first, done


def _engine_outcome(request: BenchRequest, tokens: list[int], first: float | None, end: float, finish,
                    cached: int) -> Outcome:
    from messages.common import FinishReason
    reason = FinishReason(finish)
    return Outcome(request.round, request.stream, len(request.prompt_ids), end if first is None else first, end,
                   len(tokens), cached, reason.name.lower(), request.text_of(tokens, int(reason)))


class OwnThread:
    """One long-lived daemon thread that runs the calls given to it, one at a time."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def call(self, fn, *args):
        future: Future = Future()
        self._calls.put((fn, args, future))
        return future.result()

    def _run(self) -> None:
        while True:
            fn, args, future = self._calls.get()
            try:
                future.set_result(fn(*args))
            except BaseException as exc:   # handed to the caller, which raises it
                future.set_exception(exc)


# ---- the stack over HTTP ------------------------------------------------------------------------
class StackSide:
    def __init__(self, url: str, pids: list[int]) -> None:
        self.url = f"{url}/v1/chat/completions"
        self.pids = pids                    # the stack's service processes, for their CPU time

    def run_round(self, index: int, requests: list[BenchRequest]) -> Round:
        cpu = cpu_seconds(self.pids)
        result = asyncio.run(self._round(index, requests))
        result.cpu_s = cpu_seconds(self.pids) - cpu
        return result

    async def _round(self, index: int, requests: list[BenchRequest]) -> Round:
        import aiohttp
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            start = time.perf_counter()
            outcomes = await asyncio.gather(*(self._one(session, r, start) for r in requests))
            wall = time.perf_counter() - start
        return Round("stack", index, wall, list(outcomes))

    async def _one(self, session, request: BenchRequest, start: float) -> Outcome:
        reading = SseReading(request.request_id)
        headers = {"Content-Type": "application/json", "x-request-id": request.request_id}
        async with session.post(self.url, data=request.body, headers=headers) as reply:
            if reply.status != 200:
                raise RuntimeError(f"stack: {request.request_id} answered {reply.status}: {(await reply.text())[:500]}")
            async for line in reply.content:
                if line.startswith(b"data: "):
                    reading.feed(line, time.perf_counter() - start)
        return reading.outcome(request, time.perf_counter() - start)


@dataclass(slots=True)
class SseReading:
    """One streamed Chat Completion as it arrives: when its first event and first text came, its
    frames (for the text), the finish reason and the usage of its last chunk."""
    request_id: str
    first_event: float | None = None
    first_text: float | None = None
    frames: list = field(default_factory=list)
    finish: str = ""
    usage: dict = field(default_factory=dict)

    def feed(self, line: bytes, now: float) -> None:
        if self.first_event is None:
            self.first_event = now
        self.frames.append(line)
        event = json.loads(line[6:]) if line[6:7] == b"{" else {}
        if "error" in event:
            raise RuntimeError(f"stack: {self.request_id} failed mid-stream: {event['error']}")
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            if self.first_text is None and (delta.get("content") or delta.get("reasoning_content")):
                self.first_text = now
            self.finish = choice.get("finish_reason") or self.finish
        self.usage = event.get("usage") or self.usage

    def outcome(self, request: BenchRequest, end: float) -> Outcome:
        from bench.gateway.command import visible_text
        if self.first_event is None or not self.usage:
            raise RuntimeError(f"stack: {self.request_id} streamed no events or no usage")
        reasoning, answer = visible_text(self.frames)
        cached = (self.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return Outcome(request.round, request.stream, self.usage["prompt_tokens"], self.first_event, end,
                       self.usage["completion_tokens"], cached, self.finish, reasoning + answer, self.first_text)


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of these processes (not their children), from /proc."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(") ", 1)[1].split()
        total += int(fields[11]) + int(fields[12])            # utime, stime (fields 14, 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")
