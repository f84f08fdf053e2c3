"""Test-only services for the gateway's stream handling, in-process over real ZeroMQ: a router
that forwards each GenerateRequest to one worker (or attempt k of a resumed request to worker k),
and a worker that streams scripted chunks to the gateway (naming itself on the first, as the real
workers do, and numbering each: GenerateChunk.first_index). Both record the aborts they get. With `positional`, the worker's token at output
index i is a function of the position alone (like greedy decoding), so a resumed attempt, whose
prompt ends with the tokens already streamed, continues exactly where the first one stopped."""
from __future__ import annotations

import asyncio

from messages.common import FinishReason, Usage
from messages.generate import AbortRequest, GenerateChunk, GenerateRequest
from services.runtime.service import Service

TOKEN = 3_000   # any plain-text token id of the V4 vocabulary


def positional_token(position: int) -> int:
    """The token a `positional` worker emits at sequence position `position` (plain text ids)."""
    return TOKEN + position % 50


class TestHelperRouter(Service):
    """settings: worker (the address every GenerateRequest goes on to)."""

    kind = "test_helper_router"
    __test__ = False   # not a pytest test class

    def __init__(self, config):
        super().__init__(config)
        self.aborts: list[tuple[str, str]] = []   # (request id, reason)

    def handlers(self):
        return {GenerateRequest: self._forward, AbortRequest: self._on_abort}

    async def _forward(self, msg: GenerateRequest, ctx) -> None:
        workers = self.config.settings.get("workers") or [self.config.settings["worker"]]
        attempt = int(ctx.request_id.split("#r", 1)[1]) if "#r" in ctx.request_id else 0
        self.send(workers[attempt % len(workers)], msg, request_id=ctx.request_id, span=ctx.span)

    async def _on_abort(self, msg: AbortRequest, ctx) -> None:
        self.aborts.append((ctx.request_id, msg.reason))


class TestHelperStreamingWorker(Service):
    """settings: chunks (one-token chunks to send), finish (then a STOP chunk with usage; without
    it the stream stays open, as if the worker were still generating)."""

    kind = "test_helper_streaming_worker"
    __test__ = False

    def __init__(self, config):
        super().__init__(config)
        self.aborts: list[tuple[str, str]] = []   # (request id, reason)
        self.sent: dict[str, int] = {}            # request id -> chunks sent
        self.received: dict[str, GenerateRequest] = {}   # request id -> the request as it came
        self.frozen = False                       # True: status queries go unanswered (a stopped process)

    def handlers(self):
        return {GenerateRequest: self._stream, AbortRequest: self._on_abort}

    async def _on_status(self, msg, ctx):
        if self.frozen:
            await asyncio.Event().wait()   # never answers; cancelled when the service stops
        return await super()._on_status(msg, ctx)

    async def _stream(self, msg: GenerateRequest, ctx) -> None:
        self.received[ctx.request_id] = msg
        count = min(int(self.config.settings.get("chunks", 1)), msg.sampling.max_tokens)
        chunks = [GenerateChunk([positional_token(len(msg.prompt_ids) + i) if self.config.settings.get("positional")
                                 else TOKEN], worker=self.config.advertise if i == 0 else "",
                                worker_incarnation=self.incarnation if i == 0 else "", first_index=i)
                  for i in range(count)]
        if self.config.settings.get("finish", True):
            done = FinishReason.LENGTH if count == msg.sampling.max_tokens else FinishReason.STOP
            chunks.append(GenerateChunk([], int(done), usage=Usage(len(msg.prompt_ids), 0, count), first_index=count))
        for chunk in chunks:
            self.send_chunk(msg.return_address, ctx.request_id, chunk)

    def send_chunk(self, address: str, request_id: str, chunk: GenerateChunk) -> None:
        self.send(address, chunk, request_id=request_id)
        self.sent[request_id] = self.sent.get(request_id, 0) + 1

    async def _on_abort(self, msg: AbortRequest, ctx) -> None:
        self.aborts.append((ctx.request_id, msg.reason))
