"""The `decode` worker: continues requests that a prefill worker handed over, streams their tokens.

It registers with the decode router (config.upstream) as kind "decode_worker" and heartbeats its
Load (kv_usage, batch_size, capacity = max_num_seqs) so the router can pick it.

StateHandoff (from a prefill worker, request id in the envelope; buffers as frames): the engine
restores the request from the snapshot with the tokens already produced (normally the first one,
`generated_ids`, with their logprobs when the request asked for them: one per token, or none; any
other count is refused), the worker answers StateAccepted, and those tokens and logprobs go at once
to the gateway that owns the request (`request.return_address`) as a GenerateChunk; every engine
step that produced tokens sends the next one, the last with the finish reason and usage (like the
unified worker).
AbortRequest (the prefill router forwards the gateway's) frees the request; a request whose chunks
cannot be delivered is freed too. Gateways do not register with decode workers, so the worker asks
each gateway it streams to for its status every `dead_after_s`; one that does not answer within
that time is dead and its requests are freed.

Every completed 128-token block, prompt and generated, goes to the KV writer (KvWritePages, one
frame per page, sent without waiting for the ack: never blocking a step); the window + tails states
the engine saved at block boundaries are registered with the SWA registry (holder = this worker's
advertised address) and served to prefill workers on SwaFetch.
"""
from __future__ import annotations

import asyncio
import time

from messages.common import FinishReason
from messages.control import Load, StatusQuery
from messages.errors import ErrorCode, InvalidRequest, WireError
from messages.generate import AbortRequest, GenerateChunk
from messages.handoff import StateAccepted, StateHandoff
from services.runtime.context import Context
from services.runtime.membership import Peer
from services.workers.common import EngineWorker
from services.workers.unified import Stream
from services.workers.chunks import chunk_from, fail_streams

BLOCK = 128


class DecodeWorker(EngineWorker):
    kind = "decode_worker"

    def __init__(self, config):
        super().__init__(config)
        self.streams: dict[str, Stream] = {}
        self._first: dict[str, GenerateChunk] = {}    # the hand-off's tokens, not yet sent to the gateway
        self._traffic: dict[str, int] = {}
        self._tokens: dict[str, int] = {}             # prompt + generated tokens so far
        self._stepped: set[str] = set()               # requests the engine produced output for
        self._watcher: asyncio.Task | None = None

    def handlers(self):
        return {**self.base_handlers(), StateHandoff: self._on_handoff, AbortRequest: self._on_abort}

    async def on_start(self) -> None:
        await super().on_start()
        self._watcher = asyncio.get_running_loop().create_task(self._watch_gateways())

    async def on_stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        await super().on_stop()

    async def _watch_gateways(self) -> None:
        """Free the requests of gateways that stopped answering (nobody would read their tokens)."""
        period = max(self.config.dead_after_s, 0.05)
        while True:
            await asyncio.sleep(period)
            addresses = list({s.return_address for s in self.streams.values()})
            if not addresses:
                continue
            try:
                results = await asyncio.gather(*(self._probe(a, period) for a in addresses))
                for address, alive in zip(addresses, results):
                    if not alive:
                        orphans = [s.request_id for s in self.streams.values() if s.return_address == address]
                        self.log.warning("gateway.dead", address=address, requests=len(orphans))
                        for request_id in orphans:
                            self._finish_locally(request_id, "gateway_dead")
                        self.drop_link(address)
            except Exception:   # a bug here must not end the watch for good
                self.log.exception("gateway_watch.failed")

    async def _probe(self, address: str, timeout: float) -> bool:
        try:
            await self.call(address, StatusQuery(), timeout=timeout)
            return True
        except WireError as exc:
            return exc.code not in (ErrorCode.TIMEOUT, ErrorCode.PEER_DEAD)

    def in_flight(self) -> int:
        return super().in_flight() + len(self.streams)

    def load(self) -> Load:
        stats = self._engine_stats
        return Load(queue_depth=stats.num_waiting if stats else 0, in_flight=self.in_flight(),
                    batch_size=stats.num_running if stats else 0, kv_usage=stats.kv_usage if stats else 0.0,
                    capacity=self.capacity())

    def on_peer_dead(self, peer: Peer) -> None:
        super().on_peer_dead(peer)
        for request_id in [s.request_id for s in self.streams.values() if s.return_address == peer.address]:
            self._finish_locally(request_id, "gateway_dead")

    # ---- handlers ----------------------------------------------------------------------
    async def _on_handoff(self, msg: StateHandoff, ctx: Context) -> StateAccepted:
        from engine.engine_core import EngineRequest
        rid, request = ctx.request_id, msg.request
        if not rid:
            raise InvalidRequest("StateHandoff needs a request id in the envelope")
        if rid in self.streams:
            raise InvalidRequest(f"request {rid} is already running here", request_id=rid)
        if not request.return_address:
            raise InvalidRequest("StateHandoff: the request needs a return_address", request_id=rid)
        env = ctx.envelope
        try:
            buffers = [env.tensor(i) for i in msg.buffer_frames]
        except WireError as exc:
            raise InvalidRequest(f"StateHandoff buffers: {exc.message}", request_id=rid) from None
        generated = list(msg.generated_ids)
        if any(rows and len(rows) != len(generated) for rows in (msg.logprobs, msg.top_logprobs)):
            raise InvalidRequest(f"StateHandoff: {len(msg.logprobs)} logprobs and {len(msg.top_logprobs)} top "
                                 f"logprobs for {len(generated)} generated ids (one each, or none)", request_id=rid)
        stream = Stream(rid, request.return_address, ctx.span, ctx.sender, time.time(), len(request.prompt_ids))
        stream.completion_tokens = len(generated)
        stream.cached_tokens = msg.snapshot.num_cached_tokens
        self.streams[rid] = stream
        self._first[rid] = GenerateChunk(generated, logprobs=list(msg.logprobs), top_logprobs=list(msg.top_logprobs))
        self._traffic[rid] = request.traffic_class
        self._tokens[rid] = len(request.prompt_ids) + len(generated)
        engine_request = EngineRequest(rid, list(request.prompt_ids), request.sampling,
                                       request.arrival_time or time.time())
        try:
            await self.engine(lambda engine: engine.restore(engine_request, msg.snapshot, buffers, generated))
        except ValueError as exc:
            self._forget(rid)
            raise InvalidRequest(f"cannot restore: {exc}", request_id=rid) from None
        self._flush_first(rid)
        self.log.info("request.restored", request_id=rid, prompt_tokens=len(request.prompt_ids),
                      snapshot_tokens=msg.snapshot.num_tokens, cached_tokens=msg.snapshot.num_cached_tokens,
                      max_tokens=request.sampling.max_tokens)
        return StateAccepted(True)

    async def _on_abort(self, msg: AbortRequest, ctx: Context) -> None:
        if ctx.request_id in self.streams:
            await self._abort_in_engine(ctx.request_id)
            stream = self.streams.get(ctx.request_id)
            if stream is not None:
                self._summarize(stream, f"aborted:{msg.reason or 'client'}")
                self._forget(ctx.request_id)

    # ---- engine outputs ----------------------------------------------------------------
    def _flush_first(self, rid: str) -> None:
        """The hand-off's tokens go out first (once), before anything the engine produced."""
        chunk = self._first.pop(rid, None)
        stream = self.streams.get(rid)
        if chunk is None or not chunk.token_ids or stream is None:
            return
        stream.first_token_at = time.time()
        self._deliver(stream, chunk)

    def _on_outputs(self, outputs: list) -> None:
        self._engine_stats = self.engine_thread.engine.stats()   # cheap counters, read after a step
        for out in outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:   # aborted while the step ran
                continue
            self._flush_first(out.request_id)
            if out.request_id not in self.streams:
                continue
            stream.completion_tokens += len(out.new_token_ids)
            stream.cached_tokens = out.num_cached_tokens
            finished = out.finish_reason is not None
            chunk = chunk_from(out, stream.completion_tokens)
            if not self._deliver(stream, chunk):
                continue
            before = self._tokens.get(out.request_id, 0)
            after = before + len(out.new_token_ids)
            self._tokens[out.request_id] = after
            # tokens whose KV is computed: all but the last sampled one (the first output: the prompt's)
            first_output = out.request_id not in self._stepped
            self._stepped.add(out.request_id)
            if finished or first_output or (after - 1) // BLOCK > (before - 1) // BLOCK:
                self.persist_blocks(out.request_id, stream.span, self._traffic.get(out.request_id, 0), finished)
            if finished:
                self._summarize(stream, FinishReason(out.finish_reason).name.lower())
                self._forget(out.request_id)

    def _deliver(self, stream: Stream, chunk: GenerateChunk) -> bool:
        try:
            self.send(stream.return_address, chunk, request_id=stream.request_id, span=stream.span)
            return True
        except WireError as exc:   # the gateway is gone or not reading: stop generating for it
            self.log.warning("stream.undeliverable", request_id=stream.request_id, code=exc.code.name)
            self._finish_locally(stream.request_id, "undeliverable")
            return False

    def _on_engine_failure(self, exc: Exception) -> None:
        streams = list(self.streams.items())
        fail_streams(self, streams)
        for request_id, stream in streams:
            self._summarize(stream, "engine_error")
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self.streams.pop(request_id, None)
        self._first.pop(request_id, None)
        self._traffic.pop(request_id, None)
        self._tokens.pop(request_id, None)
        self._stepped.discard(request_id)

    def _finish_locally(self, request_id: str, outcome: str) -> None:
        stream = self.streams.get(request_id)
        if stream is not None:
            self._forget(request_id)
            asyncio.get_running_loop().create_task(self._abort_in_engine(request_id))
            self._summarize(stream, outcome)

    async def _abort_in_engine(self, request_id: str) -> None:
        await self.engine(lambda engine, rid: engine.abort(rid), request_id)
        await self.refresh_stats()

    def _summarize(self, stream: Stream, outcome: str) -> None:
        done = time.time()
        decode_s = done - stream.first_token_at if stream.first_token_at else 0.0
        self.log.info(
            "request.summary", request_id=stream.request_id, trace_id=stream.span.trace_id,
            span_id=stream.span.span_id, parent_span_id=stream.span.parent_span_id or None,
            type="StateHandoff", sender=stream.sender, start=stream.received_at,
            handle_ms=round((done - stream.received_at) * 1e3, 3),
            phases={"decode_ms": round(decode_s * 1e3, 3)},
            prompt_tokens=stream.prompt_tokens, cached_tokens=stream.cached_tokens,
            completion_tokens=stream.completion_tokens, outcome=outcome)
