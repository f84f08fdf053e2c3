"""The gateway's open requests: what each HTTP handler waits on, the worker that streams it, and
the chunk counts of its one `request.summary` line. No sockets.

A token can come twice: the prefill worker streams the first one at once and the decode worker
sends it again with its address. Numbered chunks (GenerateChunk.first_index) make that exact: what
the attempt already has is dropped, and a chunk that starts past it (a lost token) is an error.

Chunks arrive one message each (a 64-token answer can be 64 messages); the runtime writes no
summary per chunk (GatewayService.streamed_types), so their timings are folded in here instead:
how many, when the first and last tokens came, and the gaps between chunks (p50 and max).
"""
from __future__ import annotations

import asyncio
import statistics
from array import array
from dataclasses import dataclass, field

import msgspec

from messages.generate import GenerateChunk
from services.runtime.tracing import SpanContext


class StreamGap(Exception):
    """A chunk starts past the tokens received: some never came."""


class ChunkStats:
    """Arrival times of one request's chunks, as summary fields (ms from the request's start)."""

    __slots__ = ("chunks", "first_token_at", "last_token_at", "_last_at", "_gaps_ms")

    def __init__(self) -> None:
        self.chunks = 0
        self.first_token_at = 0.0
        self.last_token_at = 0.0
        self._last_at = 0.0
        self._gaps_ms = array("f")   # 4 bytes a chunk: exact p50 without holding Python floats

    def add(self, at: float, tokens: int) -> None:
        """A chunk that arrived at `at` (epoch seconds) with `tokens` token ids."""
        if self.chunks:
            self._gaps_ms.append((at - self._last_at) * 1e3)
        self.chunks += 1
        self._last_at = at
        if tokens:
            self.first_token_at = self.first_token_at or at
            self.last_token_at = at

    def fields(self, start: float) -> dict:
        """`chunks` always; token times once a token came; gaps once two chunks did."""
        out: dict = {"chunks": self.chunks}
        if self.first_token_at:
            out["first_token_ms"] = round((self.first_token_at - start) * 1e3, 3)
            out["last_token_ms"] = round((self.last_token_at - start) * 1e3, 3)
        if self._gaps_ms:
            out["gap_p50_ms"] = round(statistics.median(self._gaps_ms), 3)
            out["gap_max_ms"] = round(max(self._gaps_ms), 3)
        return out


@dataclass(slots=True, eq=False)
class OpenRequest:
    """One request between its GenerateRequest and the end of its HTTP answer."""
    request_id: str
    span: SpanContext
    wire_id: str = ""             # the current attempt's id on the wire (resume.py); "" = request_id
    attempt: int = 0
    # (wire id, chunk | ErrorReply | GatewayError): the handler drops what an older attempt sent
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    worker: str = ""              # the streaming worker's address, once a chunk names it
    worker_incarnation: str = ""  # ... and which process it is (a restart there is another)
    token_ids: list[int] = field(default_factory=list)   # every token the client has received
    streamed_before: int = 0      # of those, the ones received before the current attempt began
    received: int = 0             # output tokens of the current attempt taken in (queued or shown)
    stats: ChunkStats = field(default_factory=ChunkStats)
    dead_workers: list[str] = field(default_factory=list)   # workers that died streaming it (resumes avoid them)

    def __post_init__(self) -> None:
        self.wire_id = self.wire_id or self.request_id

    def put(self, item) -> None:
        """An event of the current attempt (a watch's GatewayError, a lost upstream)."""
        self.queue.put_nowait((self.wire_id, item))

    def take(self, chunk: GenerateChunk) -> GenerateChunk | None:
        """What of the current attempt's `chunk` is new: its tokens (and logprobs) this attempt has
        not received yet; None when nothing is (a repeat). StreamGap when it starts past them."""
        first = chunk.first_index
        if first > self.received:
            raise StreamGap(f"output tokens {self.received}..{first - 1} never came (a chunk starts at {first})")
        skip = self.received - first if first >= 0 else 0   # not numbered: in order, as it comes
        if skip:
            if skip >= len(chunk.token_ids) and not (chunk.finish_reason or chunk.error or chunk.usage):
                return None
            chunk = msgspec.structs.replace(chunk, token_ids=chunk.token_ids[skip:], logprobs=chunk.logprobs[skip:],
                                            top_logprobs=chunk.top_logprobs[skip:], first_index=first + skip)
        self.received += len(chunk.token_ids)
        return chunk


def streaming_workers(requests: dict[str, OpenRequest]) -> list[tuple[str, str]]:
    """The distinct (address, incarnation) of the workers streaming open requests."""
    return sorted({(r.worker, r.worker_incarnation) for r in requests.values() if r.worker})
