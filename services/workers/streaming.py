"""StreamingWorker: an EngineWorker that streams tokens to gateways (the decode and unified workers).

Each engine step that produced tokens for a request sends the next GenerateChunk to the gateway
that owns it (`return_address`), the last one with the finish reason and usage; the first chunk
names this worker (`worker`), so the gateway aborts here and watches this worker directly.
AbortRequest (from the gateway, or a router/prefill worker forwarding one) frees the request; so
does a chunk that cannot be delivered. A gateway that stops answering loses its requests: this
worker asks each gateway it streams to for its status every `dead_after_s`. Bookkeeping lives in
the pure StreamTable (streams.py); this class only sends and logs.
"""
from __future__ import annotations

import time

from messages.common import FinishReason
from messages.control import Load
from messages.errors import WireError
from messages.generate import AbortRequest, GenerateChunk
from services.runtime.context import Context
from services.runtime import liveness
from services.runtime.membership import Peer
from services.workers.chunks import fail_streams
from services.workers.engine_worker import EngineWorker
from services.workers.streams import Stream, StreamTable, summary_fields


class StreamingWorker(EngineWorker):
    def __init__(self, config):
        super().__init__(config)
        self.streams = StreamTable(self.config.advertise, incarnation=self.incarnation)

    def stream_handlers(self):
        return {**self.base_handlers(), AbortRequest: self._on_abort}

    async def on_start(self) -> None:
        await super().on_start()
        self.start_loop(liveness.watch(self, lambda: [(a, "") for a in self.streams.addresses()], self._gateway_dead))

    def in_flight(self) -> int:
        return super().in_flight() + len(self.streams)

    def load(self) -> Load:
        """batch_size counts every request streamed here, queued in the engine or running: what the
        decode score and the capacity check need (a restored request shows at once, before its step)."""
        load = super().load()
        load.batch_size = len(self.streams)
        return load

    # ---- streaming -----------------------------------------------------------------------
    def open_stream(self, stream: Stream, generated: GenerateChunk | None = None) -> Stream:
        return self.streams.open(stream, generated)

    def send_ahead(self, request_id: str) -> None:
        """Send the tokens made before this worker (a hand-off's) at once, before any step."""
        stream = self.streams.get(request_id)
        for chunk in self.streams.ahead(request_id, time.time()):
            self._deliver(stream, chunk)

    def _on_outputs(self, outputs: list, after: object = None) -> None:
        self.stats_after_step()
        now = time.time()
        for out in outputs:
            step = self.streams.on_output(out, now)
            if step is None:
                continue
            stream = step.stream
            if not all(self._deliver(stream, chunk) for chunk in step.chunks):
                continue
            if step.persist:
                self.persister.request(stream.request_id, stream.span, stream.traffic_class, step.finished)
            if step.finished:
                self.close_stream(stream.request_id, FinishReason(out.finish_reason).name.lower())

    def _deliver(self, stream: Stream, chunk: GenerateChunk) -> bool:
        try:
            self.send(stream.return_address, chunk, request_id=stream.request_id, span=stream.span)
            return True
        except WireError as exc:   # the gateway is gone or not reading: stop generating for it
            self.log.warning("stream.undeliverable", request_id=stream.request_id, code=exc.code.name)
            self.finish_locally(stream.request_id, "undeliverable")
            return False

    def close_stream(self, request_id: str, outcome: str) -> Stream | None:
        stream = self.streams.close(request_id)
        if stream is not None:
            self.log.info("request.summary", **summary_fields(stream, outcome, time.time()))
        return stream

    def finish_locally(self, request_id: str, outcome: str) -> None:
        """Stop a request here (its gateway is gone, or will not read): free it in the engine too."""
        if self.close_stream(request_id, outcome) is not None:
            self.in_background(self.abort_in_engine(request_id), "engine_abort.failed")

    def _on_engine_failure(self, exc: Exception) -> None:
        ids = self.streams.request_ids()
        fail_streams(self, [(rid, self.streams.get(rid)) for rid in ids])
        for rid in ids:
            self.close_stream(rid, "engine_error")

    # ---- aborts and dead gateways ----------------------------------------------------------
    async def _on_abort(self, msg: AbortRequest, ctx: Context) -> None:
        if ctx.request_id in self.streams:
            self.close_stream(ctx.request_id, f"aborted:{msg.reason or 'client'}")
            self.images.cancel(ctx.request_id)   # a wait for its image embeddings ends now
            await self.abort_in_engine(ctx.request_id)

    def on_peer_dead(self, peer: Peer) -> None:
        super().on_peer_dead(peer)
        self._gateway_gone(peer.address)

    def _gateway_dead(self, address: str, _incarnation: str, _answered: bool) -> None:
        self._gateway_gone(address)
        self.drop_link(address)

    def _gateway_gone(self, address: str) -> None:
        orphans = self.streams.held_for(address)
        if orphans:
            self.log.warning("gateway.dead", address=address, requests=len(orphans))
        for request_id in orphans:
            self.finish_locally(request_id, "gateway_dead")
