"""The `decode` worker: continues requests that a prefill worker handed over, streams their tokens.

It registers with the decode router (config.upstream) as kind "decode_worker" and heartbeats its
Load (kv_usage, batch_size, capacity = max_num_seqs), which the decode router publishes in its
load table for the prefill routers to choose by.

StateHandoff (from a prefill worker, request id in the envelope; buffers as frames): the engine
restores the request from the snapshot with the tokens already produced (normally the first one,
`generated_ids`, with their logprobs when the request asked for them: one per token, or none; any
other count is refused), those tokens go at once to the gateway that owns the request
(`request.return_address`), and the worker answers StateAccepted. The prefill worker has normally
sent the first token already; this copy is numbered (GenerateChunk.first_index 0), so the gateway
shows it once, and it names this worker as the one streaming the request. Streaming, aborts and dead
gateways: StreamingWorker (streaming.py).

Every completed 128-token block, prompt and generated, goes to the KV writer and the window states
the engine saved at block boundaries are registered with the SWA registry (persist.py), and served
to prefill workers on SwaFetch (engine_worker.py).
"""
from __future__ import annotations

import time

from messages.errors import InvalidRequest, WireError
from messages.generate import AbortRequest, GenerateChunk
from messages.handoff import StateAccepted, StateHandoff
from services.runtime.context import Context
from services.workers.streaming import StreamingWorker
from services.workers.streams import Stream
from services.workers.tensors import torch_frame


class DecodeWorker(StreamingWorker):
    kind = "decode_worker"
    streamed_types = (StateHandoff, AbortRequest)   # the stream's own summary line covers them

    def handlers(self):
        return {**self.stream_handlers(), StateHandoff: self._on_handoff}

    async def _on_handoff(self, msg: StateHandoff, ctx: Context) -> StateAccepted:
        from engine.engine_core import EngineRequest
        rid, request = ctx.request_id, msg.request
        if not rid:
            raise InvalidRequest("StateHandoff needs a request id in the envelope")
        if not request.return_address:
            raise InvalidRequest("StateHandoff: the request needs a return_address", request_id=rid)
        try:
            buffers = [torch_frame(ctx.envelope, i) for i in msg.buffer_frames]
            image_rows = [torch_frame(ctx.envelope, i) if i >= 0 else None for i in msg.image_frames]
        except WireError as exc:
            raise InvalidRequest(f"StateHandoff buffers: {exc.message}", request_id=rid) from None
        if image_rows and len(image_rows) != len(request.images):
            raise InvalidRequest(f"StateHandoff: {len(image_rows)} image frames for {len(request.images)} images",
                                 request_id=rid)
        generated = list(msg.generated_ids)
        if any(rows and len(rows) != len(generated) for rows in (msg.logprobs, msg.top_logprobs)):
            raise InvalidRequest(f"StateHandoff: {len(msg.logprobs)} logprobs and {len(msg.top_logprobs)} top "
                                 f"logprobs for {len(generated)} generated ids (one each, or none)", request_id=rid)
        stream = self.open_stream(
            Stream(rid, request.return_address, ctx.span, ctx.sender, "StateHandoff", time.time(),
                   len(request.prompt_ids), request.traffic_class, cached_tokens=msg.snapshot.num_cached_tokens),
            GenerateChunk(generated, logprobs=list(msg.logprobs), top_logprobs=list(msg.top_logprobs)))
        grammar = None
        if request.grammar is not None:   # the matcher continues from the tokens produced so far
            if not msg.grammar:
                self.close_stream(rid, "refused")
                raise InvalidRequest("StateHandoff of a constrained request carries no grammar", request_id=rid)
            try:
                grammar = await self.grammars.state(request.grammar, msg.grammar, rid, produced=generated)
            except BaseException:
                self.close_stream(rid, "refused")
                raise
            if rid not in self.streams:   # aborted (or its gateway died) while the matcher was built
                return StateAccepted(False, "aborted")
        engine_request = EngineRequest(rid, list(request.prompt_ids), request.sampling,
                                       request.arrival_time or time.time(), grammar=grammar,
                                       images=list(request.images),   # their digests name its blocks
                                       image_embeds=image_rows)       # for a recompute of the tail
        try:
            await self.engine(lambda engine: engine.restore(engine_request, msg.snapshot, buffers, generated))
        except ValueError as exc:
            self.close_stream(rid, "refused")
            raise InvalidRequest(f"cannot restore: {exc}", request_id=rid) from None
        self.send_ahead(rid)
        self.log.info("request.restored", request_id=rid, prompt_tokens=stream.prompt_tokens,
                      snapshot_tokens=msg.snapshot.num_tokens, cached_tokens=stream.cached_tokens,
                      max_tokens=request.sampling.max_tokens)
        return StateAccepted(True)
