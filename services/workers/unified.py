"""The `unified` worker: prefill and decode in one process around one EngineCore.

GenerateRequest in (from a gateway); GenerateChunk messages out to the gateway that owns the
request (`return_address`), one per engine step that produced tokens, the last one with the finish
reason and usage. Streaming, aborts and dead gateways: StreamingWorker (streaming.py). A gateway
registers with it (it is the gateway's upstream), so a gateway that stops heartbeating loses its
requests at once.
"""
from __future__ import annotations

import time

from messages.errors import InvalidRequest
from messages.generate import AbortRequest, GenerateRequest
from messages.vision import VisionEncoded, VisionFailed
from services.runtime.context import Context
from services.workers.hash_check import HashChainCheck
from services.workers.streaming import StreamingWorker
from services.workers.streams import Stream


class UnifiedWorker(StreamingWorker):
    kind = "unified_worker"
    # the stream's own summary line covers them
    streamed_types = (GenerateRequest, AbortRequest, VisionEncoded, VisionFailed)
    continuation_types = (VisionEncoded, VisionFailed)

    def __init__(self, config):
        super().__init__(config)
        self.hash_check = HashChainCheck()

    def handlers(self):
        return {**self.stream_handlers(), GenerateRequest: self._on_generate}

    async def _on_generate(self, msg: GenerateRequest, ctx: Context) -> None:
        from engine.engine_core import EngineRequest
        request_id = ctx.request_id
        if not request_id:
            raise InvalidRequest("GenerateRequest needs a request id in the envelope")
        if not msg.return_address:
            raise InvalidRequest("GenerateRequest needs a return_address", request_id=request_id)
        self.hash_check.check(self.log, self.model_id, msg.prompt_ids, msg.block_hashes, msg.images)
        self.open_stream(Stream(request_id, msg.return_address, ctx.span, ctx.sender, "GenerateRequest", time.time(),
                                len(msg.prompt_ids), msg.traffic_class))
        try:
            grammar = None
            if msg.grammar is not None:   # the compile was started by the gateway; the answer is cached by now
                artifact = await self.grammars.fetch(msg.grammar, request_id, ctx.span)
                grammar = await self.grammars.state(msg.grammar, artifact, request_id)
                if self.streams.get(request_id) is None:   # aborted while its grammar came
                    return
            images, image_rows = self.images.images_of(msg, ctx.envelope), []
            if images:   # every image: this engine's own prefix cache decides the hit only at admission
                image_rows = await self.images.start(request_id, images, msg.vision_groups, 0, ctx.span)
                if self.streams.get(request_id) is None:   # aborted while its images were encoded
                    return
            request = EngineRequest(request_id, list(msg.prompt_ids), msg.sampling, msg.arrival_time or time.time(),
                                    msg.exact_prefix, grammar=grammar, images=list(msg.images), image_embeds=image_rows)
            await self.engine(lambda engine, req: engine.add_request(req), request)
        except ValueError as exc:
            self.close_stream(request_id, "refused")
            raise InvalidRequest(str(exc), request_id=request_id) from None
        except BaseException:
            self.close_stream(request_id, "refused")
            raise
        self.log.info("request.accepted", request_id=request_id, prompt_tokens=len(msg.prompt_ids),
                      max_tokens=msg.sampling.max_tokens)
