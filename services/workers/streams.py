"""StreamTable: the pure bookkeeping of the requests a worker streams to gateways (no sockets).

One `Stream` record per request holds everything about it: where its tokens go, what started it,
the tokens produced before it came here (a hand-off's first token, sent ahead of anything the
engine makes), counts for usage and the summary line, and what block persistence needs. The
workers (streaming.py) feed engine outputs in and send what `on_output` says; tests drive it alone.
"""
from __future__ import annotations

from dataclasses import dataclass

from messages.errors import InvalidRequest
from messages.generate import GenerateChunk
from messages.prefix import BLOCK_TOKENS
from services.runtime.tracing import SpanContext
from services.workers.chunks import chunk_from


@dataclass(slots=True)
class Stream:
    request_id: str
    return_address: str          # the gateway that owns the request
    span: SpanContext
    sender: str                  # who started it here (gateway, prefill worker)
    started_by: str              # the message type that started it (GenerateRequest, StateHandoff)
    received_at: float
    prompt_tokens: int
    traffic_class: int = 0
    ahead: GenerateChunk | None = None   # tokens produced before this worker, not yet sent
    first_token_at: float = 0.0
    completion_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0     # prompt + generated tokens whose KV exists or is being made here
    stepped: bool = False        # the engine produced output for it
    announced: bool = False      # a chunk carrying this worker's address went out


@dataclass(slots=True)
class Delivery:
    """What one engine output means for its stream: chunks to send in order, whether new full
    blocks may exist (persist them), whether it finished."""

    stream: Stream
    chunks: list[GenerateChunk]
    persist: bool
    finished: bool


class StreamTable:
    def __init__(self, worker_address: str, block_tokens: int = BLOCK_TOKENS, incarnation: str = ""):
        self.worker_address = worker_address
        self.incarnation = incarnation
        self.block_tokens = block_tokens
        self._streams: dict[str, Stream] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def get(self, request_id: str) -> Stream | None:
        return self._streams.get(request_id)

    def open(self, stream: Stream, generated: GenerateChunk | None = None) -> Stream:
        """Start streaming a request; `generated`: tokens made before it came here (sent first)."""
        if stream.request_id in self._streams:
            raise InvalidRequest(f"request {stream.request_id} is already running here", request_id=stream.request_id)
        stream.computed_tokens = stream.prompt_tokens
        if generated is not None and generated.token_ids:
            generated.first_index = 0   # they are the output's first tokens, whoever sent them before
            stream.ahead = generated
            stream.completion_tokens = stream.computed_tokens = len(generated.token_ids)
            stream.computed_tokens += stream.prompt_tokens
        self._streams[stream.request_id] = stream
        return stream

    def close(self, request_id: str) -> Stream | None:
        return self._streams.pop(request_id, None)

    def ahead(self, request_id: str, now: float) -> list[GenerateChunk]:
        """The tokens made before this worker, once: they go out before anything the engine makes."""
        stream = self._streams.get(request_id)
        if stream is None or stream.ahead is None:
            return []
        chunk, stream.ahead = stream.ahead, None
        stream.first_token_at = stream.first_token_at or now
        return [self._announce(stream, chunk)]

    def on_output(self, out, now: float) -> Delivery | None:
        """`out` is an engine RequestOutput; None when its request is no longer streamed here."""
        stream = self._streams.get(out.request_id)
        if stream is None:   # aborted while the step ran
            return None
        chunks = self.ahead(out.request_id, now)
        new = len(out.new_token_ids)
        if new and not stream.first_token_at:
            stream.first_token_at = now
        stream.completion_tokens += new
        stream.cached_tokens = out.num_cached_tokens
        finished = out.finish_reason is not None
        chunks.append(self._announce(stream, chunk_from(out, stream.completion_tokens, stream.completion_tokens - new)))
        # KV exists for every token but the last sampled one (the first output: the prompt's)
        before, stream.computed_tokens = stream.computed_tokens, stream.computed_tokens + new
        crossed = (stream.computed_tokens - 1) // self.block_tokens > (before - 1) // self.block_tokens
        first_output, stream.stepped = not stream.stepped, True
        return Delivery(stream, chunks, finished or first_output or crossed, finished)

    def _announce(self, stream: Stream, chunk: GenerateChunk) -> GenerateChunk:
        if not stream.announced:
            stream.announced = True
            chunk.worker, chunk.worker_incarnation = self.worker_address, self.incarnation
        return chunk

    def held_for(self, address: str) -> list[str]:
        """The requests streamed to the gateway at `address`."""
        return [s.request_id for s in self._streams.values() if s.return_address == address]

    def addresses(self) -> set[str]:
        return {s.return_address for s in self._streams.values()}

    def request_ids(self) -> list[str]:
        return list(self._streams)


def summary_fields(stream: Stream, outcome: str, now: float) -> dict:
    """The fields of the stream's one `request.summary` line."""
    ttft = (stream.first_token_at - stream.received_at) * 1e3 if stream.first_token_at else None
    decode_s = now - stream.first_token_at if stream.first_token_at else 0.0
    return dict(request_id=stream.request_id, trace_id=stream.span.trace_id, span_id=stream.span.span_id,
                parent_span_id=stream.span.parent_span_id or None, type=stream.started_by, sender=stream.sender,
                start=stream.received_at, handle_ms=round((now - stream.received_at) * 1e3, 3),
                phases={"ttft_ms": round(ttft, 3) if ttft is not None else None,
                        "decode_ms": round(decode_s * 1e3, 3)},
                prompt_tokens=stream.prompt_tokens, cached_tokens=stream.cached_tokens,
                completion_tokens=stream.completion_tokens, outcome=outcome)
