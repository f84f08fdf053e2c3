"""The `unified` worker: prefill and decode in one process around one EngineCore.

GenerateRequest in (from a gateway, or later a router); GenerateChunk messages out to the
gateway that owns the request (`return_address`), one per engine step that produced tokens, the
last one with the finish reason and usage. AbortRequest (client disconnect) frees the request.
A gateway that stops heartbeating loses its requests: nobody would read their tokens.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from messages.common import FinishReason
from messages.control import Load
from messages.errors import InvalidRequest, WireError
from messages.generate import AbortRequest, GenerateRequest
from services.runtime.context import Context
from services.runtime.membership import Peer
from services.runtime.service import Service
from services.workers.chunks import chunk_from, fail_streams
from services.runtime.tracing import SpanContext
from services.workers.engine_thread import EngineThread
from services.workers.hash_check import HashChainCheck


@dataclass(slots=True)
class Stream:
    """A request this worker is generating for, and where its tokens go."""

    request_id: str
    return_address: str
    span: SpanContext
    sender: str
    received_at: float
    prompt_tokens: int
    first_token_at: float = 0.0
    completion_tokens: int = 0
    cached_tokens: int = 0
    phases: dict[str, float] = field(default_factory=dict)


class UnifiedWorker(Service):
    kind = "unified_worker"

    def __init__(self, config):
        super().__init__(config)
        self.streams: dict[str, Stream] = {}
        self.engine_thread: EngineThread | None = None
        self._engine_stats = None
        self.model_id = ""
        self.hash_check = HashChainCheck()

    def handlers(self):
        return {GenerateRequest: self._on_generate, AbortRequest: self._on_abort}

    # ---- lifecycle ---------------------------------------------------------------------
    async def on_start(self) -> None:
        from engine.engine_core import EngineConfig, EngineCore   # torch only in worker processes
        settings = dict(self.config.settings)
        engine_config = EngineConfig(**{k: v for k, v in settings.items() if k in EngineConfig.__slots__})
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        engine = await loop.run_in_executor(None, EngineCore, engine_config)
        self.engine_thread = EngineThread(engine, self._on_outputs, self._on_engine_failure, loop,
                                          name=f"engine-{self.config.instance}")
        self.engine_thread.start()
        self._engine_stats = engine.stats()
        self.model_id = engine.model_id
        self.log.info("engine.loaded", model_dir=engine_config.model_dir, model_id=engine.model_id,
                      load_s=round(time.monotonic() - started, 3), pages=self._engine_stats.pages_total)

    async def on_stop(self) -> None:
        if self.engine_thread is not None:
            self.engine_thread.stop()

    def in_flight(self) -> int:
        return super().in_flight() + len(self.streams)

    def load(self) -> Load:
        stats = self._engine_stats
        return Load(queue_depth=stats.num_waiting if stats else 0, in_flight=self.in_flight(),
                    batch_size=stats.num_running if stats else 0, kv_usage=stats.kv_usage if stats else 0.0)

    def on_peer_dead(self, peer: Peer) -> None:
        super().on_peer_dead(peer)
        orphans = [s.request_id for s in self.streams.values() if s.return_address == peer.address]
        for request_id in orphans:
            self._finish_locally(request_id, "gateway_dead")

    # ---- handlers ----------------------------------------------------------------------
    async def _on_generate(self, msg: GenerateRequest, ctx: Context) -> None:
        from engine.engine_core import EngineRequest
        request_id = ctx.request_id
        if not request_id:
            raise InvalidRequest("GenerateRequest needs a request id in the envelope")
        if request_id in self.streams:
            raise InvalidRequest(f"request {request_id} is already running here", request_id=request_id)
        if not msg.return_address:
            raise InvalidRequest("GenerateRequest needs a return_address", request_id=request_id)
        self.hash_check.check(self.log, self.model_id, msg.prompt_ids, msg.block_hashes)
        stream = Stream(request_id, msg.return_address, ctx.span, ctx.sender, time.time(), len(msg.prompt_ids))
        self.streams[request_id] = stream
        request = EngineRequest(request_id, list(msg.prompt_ids), msg.sampling, msg.arrival_time or time.time())
        try:
            await self.engine_thread.call(lambda engine, req: engine.add_request(req), request)
        except ValueError as exc:
            del self.streams[request_id]
            raise InvalidRequest(str(exc), request_id=request_id) from None
        self.log.info("request.accepted", request_id=request_id, prompt_tokens=len(msg.prompt_ids),
                      max_tokens=msg.sampling.max_tokens)

    async def _on_abort(self, msg: AbortRequest, ctx: Context) -> None:
        if ctx.request_id in self.streams:
            await self._abort_in_engine(ctx.request_id)
            self._summarize(self.streams.pop(ctx.request_id), f"aborted:{msg.reason or 'client'}")

    # ---- engine outputs ----------------------------------------------------------------
    def _on_outputs(self, outputs: list) -> None:
        self._engine_stats = self.engine_thread.engine.stats()   # cheap counters, read after a step
        now = time.time()
        for out in outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:   # aborted while the step ran
                continue
            if out.new_token_ids and not stream.first_token_at:
                stream.first_token_at = now
            stream.completion_tokens += len(out.new_token_ids)
            stream.cached_tokens = out.num_cached_tokens
            finished = out.finish_reason is not None
            chunk = chunk_from(out, stream.completion_tokens)
            try:
                self.send(stream.return_address, chunk, request_id=out.request_id, span=stream.span)
            except WireError as exc:   # the gateway is gone or not reading: stop generating for it
                self.log.warning("stream.undeliverable", request_id=out.request_id, code=exc.code.name)
                self._finish_locally(out.request_id, "undeliverable")
                continue
            if finished:
                self._summarize(self.streams.pop(out.request_id), FinishReason(out.finish_reason).name.lower())

    def _on_engine_failure(self, exc: Exception) -> None:
        streams = list(self.streams.items())
        fail_streams(self, streams)
        for request_id, _ in streams:
            self._summarize(self.streams.pop(request_id), "engine_error")

    def _finish_locally(self, request_id: str, outcome: str) -> None:
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            asyncio.get_running_loop().create_task(self._abort_in_engine(request_id))
            self._summarize(stream, outcome)

    async def _abort_in_engine(self, request_id: str) -> None:
        await self.engine_thread.call(lambda engine, rid: engine.abort(rid), request_id)
        self._engine_stats = await self.engine_thread.call(lambda engine: engine.stats())

    def _summarize(self, stream: Stream, outcome: str) -> None:
        done = time.time()
        ttft = (stream.first_token_at - stream.received_at) * 1e3 if stream.first_token_at else None
        decode_s = done - stream.first_token_at if stream.first_token_at else 0.0
        self.log.info(
            "request.summary", request_id=stream.request_id, trace_id=stream.span.trace_id,
            span_id=stream.span.span_id, parent_span_id=stream.span.parent_span_id or None,
            type="GenerateRequest", sender=stream.sender, start=stream.received_at,
            handle_ms=round((done - stream.received_at) * 1e3, 3),
            phases={"ttft_ms": round(ttft, 3) if ttft is not None else None,
                    "decode_ms": round(decode_s * 1e3, 3)},
            prompt_tokens=stream.prompt_tokens, cached_tokens=stream.cached_tokens,
            completion_tokens=stream.completion_tokens, outcome=outcome)
