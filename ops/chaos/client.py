"""The clients of the chaos scenarios: requests to the gateway over HTTP (aiohttp), each with a
deadline, recording when every chunk of a stream arrived.

A stream that stops sending gets no further than `chunk_timeout_s` past its last chunk, and no
request lives past `total_timeout_s`: the result then carries the error and the stall it saw.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

CHAT_PATH = "/v1/chat/completions"
MESSAGES_PATH = "/v1/messages"
POLL_S = 0.02


@dataclass(slots=True)
class Limits:
    chunk_timeout_s: float = 60.0      # longest silence a stream may keep before we give up on it
    total_timeout_s: float = 300.0     # longest any one request may take
    connect_timeout_s: float = 10.0


@dataclass(slots=True)
class Result:
    """One request as the client saw it."""
    index: int
    protocol: str = "chat"             # chat | messages
    status: int = 0                    # HTTP status; 0 when no response head came
    text: str = ""                     # every text delta (answer and reasoning), in order
    chunk_times: list[float] = field(default_factory=list)   # s since sent, each SSE data event with text
    finish: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    done: bool = False                 # the terminal event ([DONE], message_stop, or a whole JSON body)
    disconnected: bool = False         # closed by us on purpose
    retry_after: str | None = None
    error: str = ""
    ended_s: float = 0.0

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.done and not self.error

    def summary(self) -> dict:
        return {"index": self.index, "protocol": self.protocol, "status": self.status, "completed": self.completed,
                "chunks": len(self.chunk_times), "first_chunk_s": round(self.chunk_times[0], 3) if self.chunk_times
                else None, "ended_s": round(self.ended_s, 3), "stall_s": round(self.stall_s, 3),
                "finish": self.finish, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "cached_tokens": self.cached_tokens, "error": self.error}

    @property
    def stall_s(self) -> float:
        """The longest silence this client sat through: send -> first text -> ... -> the end."""
        return longest_gap([0.0, *self.chunk_times, self.ended_s])


def longest_gap(times: list[float]) -> float:
    return max((b - a for a, b in zip(times, times[1:])), default=0.0)


def chat_body(model: str, text: str, max_tokens: int, stream: bool = True) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream, "thinking": {"type": "disabled"}}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def messages_body(model: str, text: str, max_tokens: int, stream: bool = True) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream, "thinking": {"type": "disabled"}}


def session(limits: Limits):
    """An aiohttp session without a connection cap (a storm opens hundreds at once)."""
    import aiohttp
    timeout = aiohttp.ClientTimeout(total=limits.total_timeout_s, sock_connect=limits.connect_timeout_s,
                                    sock_read=limits.chunk_timeout_s)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout)


async def request(http, url: str, body: dict, index: int, protocol: str = "chat",
                  stop_after_chunks: int | None = None, on_chunk=None) -> Result:
    """POST one request; stream it if the body asks to. `stop_after_chunks`: disconnect after that
    many text chunks. `on_chunk(result)` is called after each one (progress for the scenario)."""
    import aiohttp
    result = Result(index, protocol)
    start = time.monotonic()
    try:
        async with http.post(url, json=body, headers={"x-request-id": f"chaos-{index}-{time.time_ns()}"}) as reply:
            result.status, result.retry_after = reply.status, reply.headers.get("Retry-After")
            if reply.status != 200:
                result.error = f"HTTP {reply.status}: {_error_text(await reply.read())}"
            elif not body.get("stream"):
                _read_whole(result, await reply.json())
            else:
                await _read_stream(reply, result, start, stop_after_chunks, on_chunk)
    except (asyncio.TimeoutError, aiohttp.ServerTimeoutError):
        result.error = result.error or "client deadline: no data in time"
    except aiohttp.ClientError as exc:
        result.error = result.error or f"{type(exc).__name__}: {exc}"
    result.ended_s = time.monotonic() - start
    return result


async def _read_stream(reply, result: Result, start: float, stop_after: int | None, on_chunk) -> None:
    async for line in reply.content:
        if not line.startswith(b"data: "):
            continue
        payload = line[6:].strip()
        if payload == b"[DONE]":
            result.done = True
            continue
        event = json.loads(payload)
        if feed_event(result, event):
            result.chunk_times.append(time.monotonic() - start)
            if on_chunk:
                on_chunk(result)
            if stop_after is not None and len(result.chunk_times) >= stop_after:
                result.disconnected = True
                reply.close()                 # drops the connection: the gateway sees the client leave
                return


def feed_event(result: Result, event: dict) -> bool:
    """Take one streamed event (Chat Completions chunk or Anthropic Messages event) into the
    result; True when it carried text."""
    if "error" in event and event.get("type") in (None, "error"):
        error = event["error"]
        result.error = f"stream error: {error.get('message', error) if isinstance(error, dict) else error}"
        return False
    kind = event.get("type")
    if kind is None:                                              # a Chat Completions chunk
        text = ""
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            text += (delta.get("reasoning_content") or "") + (delta.get("content") or "")
            result.finish = choice.get("finish_reason") or result.finish
        _take_usage(result, event.get("usage"))
        result.text += text
        return bool(text)
    if kind == "content_block_delta":
        delta = event.get("delta") or {}
        text = delta.get("text") or delta.get("thinking") or ""
        result.text += text
        return bool(text)
    if kind == "message_delta":
        result.finish = (event.get("delta") or {}).get("stop_reason") or result.finish
        _take_usage(result, event.get("usage"))
    elif kind == "message_stop":
        result.done = True
    return False


def _read_whole(result: Result, body: dict) -> None:
    """A non-streamed answer: Chat Completion or Anthropic Message."""
    if "choices" in body:
        choice = body["choices"][0]
        result.text = (choice["message"].get("reasoning_content") or "") + (choice["message"].get("content") or "")
        result.finish = choice.get("finish_reason") or ""
    else:
        result.text = "".join(block.get("text") or block.get("thinking") or "" for block in body.get("content", []))
        result.finish = body.get("stop_reason") or ""
    _take_usage(result, body.get("usage"))
    result.done = True


def _take_usage(result: Result, usage: dict | None) -> None:
    if not usage:
        return
    result.prompt_tokens = usage.get("prompt_tokens", usage.get("input_tokens", result.prompt_tokens))
    result.completion_tokens = usage.get("completion_tokens", usage.get("output_tokens", result.completion_tokens))
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens", usage.get("cache_read_input_tokens"))
    result.cached_tokens = cached if cached is not None else result.cached_tokens


def _error_text(raw: bytes) -> str:
    try:
        body = json.loads(raw)
        error = body.get("error", body)
        return str(error.get("message", error) if isinstance(error, dict) else error)[:200]
    except ValueError:
        return raw[:200].decode(errors="replace")


class Flight:
    """Requests sent at once, watched while they run: a scenario waits on their progress (how many
    are streaming) before it injects its fault, then collects every result."""

    def __init__(self, http, url: str, bodies: list[dict], protocol: str = "chat",
                 stop_after_chunks: int | None = None) -> None:
        self.chunks = [0] * len(bodies)
        self.started_at = time.monotonic()
        self.tasks = [asyncio.create_task(request(http, url, body, i, protocol, stop_after_chunks, self._seen))
                      for i, body in enumerate(bodies)]

    def _seen(self, result: Result) -> None:
        self.chunks[result.index] += 1

    def streaming(self, min_chunks: int = 1) -> int:
        """How many requests have had at least `min_chunks` text chunks so far."""
        return sum(c >= min_chunks for c in self.chunks)

    def finished(self) -> int:
        return sum(t.done() for t in self.tasks)

    async def wait_for(self, predicate, timeout_s: float) -> bool:
        """Wait until predicate() holds or every request ended; False at the deadline or when
        they all ended first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return True
            if self.finished() == len(self.tasks):
                return False
            await asyncio.sleep(POLL_S)
        return False

    async def results(self) -> list[Result]:
        return list(await asyncio.gather(*self.tasks))
