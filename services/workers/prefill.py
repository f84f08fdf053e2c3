"""The `prefill` worker: prefills routed requests and hands their state to a decode worker.

It registers with the prefill router (config.upstream) as kind "prefill_worker" and heartbeats its
Load: in_flight = PrefillWork it holds, queued_tokens = uncached prompt tokens it has still to
prefill, capacity = most requests it takes at once (settings.capacity, default max_num_seqs).

PrefillWork (request id in the envelope) -> the reply on the same path, PrefillDone or ErrorReply:
1. `hit_tokens` > 0: the hit blocks' pages come from the KV store (StoreReader on
   settings.kv_store_dir, else KvReadPages to settings.kv_writer); when `swa_holder` is set the
   window + tails at hit_tokens come from that holder (SwaFetch); engine.import_prefix puts both
   in the prefix cache. Blocks this engine already holds with their boundary state are not read
   again. A store or holder that fails only shortens the hit: it never fails the request.
2. engine.add_request(prefill_only=True): the first token comes out and the state is held.
3. snapshot -> StateHandoff (buffers as frames, generated_ids = the first token, with its logprobs
   when asked) to `decode_address` with call(), awaiting StateAccepted -> release ->
   PrefillDone(hit_tokens = prompt tokens the engine took from its prefix cache, computed_tokens =
   the rest).
   A first token that already finishes the request (EOS, max_tokens=1) goes to the gateway from
   here as the last chunk; nothing is handed off.
AbortRequest from the router cancels the request (an ErrorReply ABORTED answers the PrefillWork,
which the router ignores by then). The boundary states the prefill saved are registered with the
SWA registry and served on SwaFetch, like the decode worker's.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from messages.control import Load
from messages.errors import ErrorCode, InvalidRequest, RemoteError, WireError
from messages.generate import AbortRequest
from messages.handoff import BufferRole, KVSnapshot, StateHandoff, SwaFetch
from messages.kv_store import KvReadPages
from messages.routing import PrefillDone, PrefillWork
from services.runtime.context import Context
from services.runtime.tracing import SpanContext
from services.workers.chunks import chunk_from, logprob_fields
from services.workers.common import EngineWorker
from services.workers.hash_check import HashChainCheck

BLOCK = 128


class Aborted(WireError):
    code = ErrorCode.ABORTED


class EngineFailed(WireError):
    code = ErrorCode.INTERNAL


@dataclass(slots=True)
class Job:
    request_id: str
    uncached_tokens: int
    future: asyncio.Future | None = None
    prefilled: bool = False
    aborted: str = ""


def _usable_prefix(engine, hashes: list[bytes]) -> int:
    """Prefix tokens this engine can already serve from its cache for the chain (pages + state)."""
    usable = getattr(engine.kv, "usable_prefix", None)
    return usable(hashes) if usable is not None else 0


class PrefillWorker(EngineWorker):
    kind = "prefill_worker"

    def __init__(self, config):
        super().__init__(config)
        self.jobs: dict[str, Job] = {}
        self._reader = None
        self.hash_check = HashChainCheck()

    def handlers(self):
        return {**self.base_handlers(), PrefillWork: self._on_work, AbortRequest: self._on_abort}

    async def on_start(self) -> None:
        await super().on_start()
        if self.settings.kv_store_dir:
            from services.kv_writer.reader import StoreReader
            self._reader = StoreReader(self.settings.kv_store_dir, log=self.log.bind(component="kv_store_reader"))

    async def on_stop(self) -> None:
        await super().on_stop()
        if self._reader is not None:
            self._reader.close()

    def in_flight(self) -> int:
        return super().in_flight() + len(self.jobs)

    def load(self) -> Load:
        stats = self._engine_stats
        return Load(queue_depth=stats.num_waiting if stats else 0, in_flight=len(self.jobs),
                    batch_size=stats.num_running if stats else 0, kv_usage=stats.kv_usage if stats else 0.0,
                    queued_tokens=sum(j.uncached_tokens for j in self.jobs.values() if not j.prefilled),
                    capacity=self.capacity())

    # ---- PrefillWork ---------------------------------------------------------------------
    async def _on_work(self, msg: PrefillWork, ctx: Context) -> PrefillDone:
        from engine.engine_core import EngineRequest
        rid, request = ctx.request_id, msg.request
        if not rid or not request.prompt_ids or not request.return_address:
            raise InvalidRequest("PrefillWork needs a request id, prompt_ids and a return_address", request_id=rid)
        if not msg.decode_address:
            raise InvalidRequest("PrefillWork has no decode_address (is a decode router configured?)", request_id=rid)
        if rid in self.jobs:
            raise InvalidRequest(f"request {rid} is already prefilling here", request_id=rid)
        self.hash_check.check(self.log, self.model_id, request.prompt_ids, request.block_hashes)
        prompt_len = len(request.prompt_ids)
        job = self.jobs[rid] = Job(rid, prompt_len - msg.hit_tokens)
        started = time.time()
        added = False
        try:
            usable = await self._load_prefix(msg, rid, ctx.span)
            job.uncached_tokens = prompt_len - max(usable, 0)
            if job.aborted:
                raise Aborted(f"aborted: {job.aborted}", request_id=rid)
            job.future = asyncio.get_running_loop().create_future()
            engine_request = EngineRequest(rid, list(request.prompt_ids), request.sampling,
                                           request.arrival_time or time.time())
            try:
                await self.engine(lambda engine: engine.add_request(engine_request, prefill_only=True))
            except ValueError as exc:
                raise InvalidRequest(str(exc), request_id=rid) from None
            added = True
            out, taken = await job.future
            job.prefilled = True
            prefilled_at = time.time()
            hit = out.num_cached_tokens
            if out.finish_reason is not None:   # the first token ended it: nothing to hand off
                added = False
                self._send_last_chunk(request.return_address, rid, ctx.span, out)
            else:
                await self._hand_off(msg, rid, ctx.span, out, taken)
                added = False
            self.in_background(self._advertise_prompt_states(request, rid, ctx.span), "swa_advertise.failed",
                               level="warning")
            self.log.info("request.prefilled", request_id=rid, prompt_tokens=prompt_len, hit_tokens=hit,
                          routed_hit_tokens=msg.hit_tokens, decode=msg.decode_address,
                          prefill_ms=round((prefilled_at - started) * 1e3, 3),
                          handoff_ms=round((time.time() - prefilled_at) * 1e3, 3))
            return PrefillDone(hit_tokens=hit, computed_tokens=prompt_len - hit)
        finally:
            self.jobs.pop(rid, None)
            if added:   # failed or aborted after the engine took it: free its state
                await self.engine(lambda engine, r: engine.abort(r), rid)
            await self.refresh_stats()

    async def _advertise_prompt_states(self, request, rid: str, span: SpanContext) -> None:
        """Register the window states this prefill saved at the prompt's block boundaries (the
        decode worker persists the pages; these states exist only here)."""
        if not self.settings.swa_registry or len(request.prompt_ids) < BLOCK:
            return
        hashes = list(request.block_hashes)
        if len(hashes) != len(request.prompt_ids) // BLOCK:
            from engine.kv.prefix_hash import block_hashes
            hashes = block_hashes(self.model_id, list(request.prompt_ids))
        held = await self.engine(lambda engine: [h for h in hashes if h in engine.kv.boundaries])
        self.advertise_states(held, rid, span)

    async def _hand_off(self, msg: PrefillWork, rid: str, span: SpanContext, out, taken) -> None:
        """`taken`: the snapshot `after_step` took right after the prompt's step (or the error it
        raised); None only if the step's outputs came without one (then ask the engine now)."""
        if isinstance(taken, Exception):
            raise EngineFailed(f"snapshot for the hand-off failed: {taken!r}", request_id=rid)
        if taken is None:
            taken = await self.engine(lambda engine, r: engine.snapshot(r), rid)
        snapshot, buffers = taken
        logprobs, top_logprobs = logprob_fields(out)
        handoff = StateHandoff(msg.request, snapshot, list(range(len(buffers))), list(out.new_token_ids),
                               logprobs, top_logprobs)
        try:
            reply = await self.call(msg.decode_address, handoff, request_id=rid, span=span, buffers=buffers,
                                    timeout=self.settings.handoff_timeout_s)
        except BaseException as exc:
            if not isinstance(exc, RemoteError):   # no answer: it may still arrive there, so abort it there
                try:
                    self.send(msg.decode_address, AbortRequest("handoff_failed"), request_id=rid, span=span)
                except WireError:
                    pass
            await self.engine(lambda engine, r: engine.abort(r), rid)
            raise
        await self.engine(lambda engine, r: engine.release(r), rid)
        accepted = reply.message
        if not getattr(accepted, "accepted", False):
            raise InvalidRequest(f"decode worker refused the state: {getattr(accepted, 'reason', '')}",
                                 request_id=rid)

    def _send_last_chunk(self, address: str, rid: str, span: SpanContext, out) -> None:
        self.send(address, chunk_from(out, len(out.new_token_ids)), request_id=rid, span=span)

    # ---- loading the hit prefix ------------------------------------------------------------
    async def _load_prefix(self, msg: PrefillWork, rid: str, span: SpanContext) -> int:
        """Put the routed hit into the prefix cache; returns the usable prefix tokens (0 on any miss)."""
        blocks = msg.hit_tokens // BLOCK
        hashes = list(msg.request.block_hashes[:blocks])
        if blocks <= 0 or len(hashes) < blocks:
            return 0
        local = await self.engine(_usable_prefix, hashes)
        if local >= blocks * BLOCK:
            return local
        try:
            pages = await self._read_pages(hashes, rid, span)
        except WireError as exc:
            self.log.warning("kv_read.failed", request_id=rid, code=exc.code.name, error=exc.message)
            return local
        if not pages:
            return local
        hashes = hashes[: len(pages)]
        boundary = None
        if msg.swa_holder and len(pages) == blocks and msg.swa_holder != self.config.advertise:
            boundary = await self._fetch_boundary(msg.swa_holder, hashes[-1], rid, span)
        try:
            usable = await self.engine(lambda engine: engine.import_prefix(hashes, [[p] for p in pages], boundary))
        except ValueError as exc:
            self.log.warning("import_prefix.failed", request_id=rid, error=str(exc))
            return local
        self.log.info("prefix.imported", request_id=rid, blocks=len(pages), with_state=boundary is not None,
                      usable_tokens=usable)
        return usable

    async def _read_pages(self, hashes: list[bytes], rid: str, span: SpanContext) -> list:
        if self._reader is not None:
            reader, layout = self._reader, self.layout
            return await asyncio.get_running_loop().run_in_executor(
                None, lambda: reader.read(hashes, layout=layout))
        if not self.settings.kv_writer:
            return []
        pages: list = []
        while len(pages) < len(hashes):   # a reply holds at most the writer's max_read_bytes
            envelope = await self.call(self.settings.kv_writer, KvReadPages(hashes[len(pages):], self.layout),
                                       request_id=rid, span=span, timeout=self.settings.fetch_timeout_s)
            reply = envelope.message
            got = [envelope.tensor(i) for i in reply.page_frames[: reply.found]]
            if not got:
                break
            pages += got
        return pages

    async def _fetch_boundary(self, holder: str, block_hash: bytes, rid: str, span: SpanContext):
        try:
            envelope = await self.call(holder, SwaFetch(block_hash), request_id=rid, span=span,
                                       timeout=self.settings.fetch_timeout_s)
        except WireError as exc:
            self.log.warning("swa_fetch.failed", request_id=rid, holder=holder, code=exc.code.name, error=exc.message)
            return None
        state = envelope.message
        if not state.found or not state.swa_frames or not state.tail_frames:
            self.log.info("swa_fetch.miss", request_id=rid, holder=holder)
            return None
        header = KVSnapshot(model_id=self.model_id, num_tokens=state.num_tokens, block_hashes=[block_hash],
                            roles=[int(BufferRole.SWA), int(BufferRole.TAILS)])
        try:
            return header, [envelope.tensor(state.swa_frames[0]), envelope.tensor(state.tail_frames[0])]
        except WireError as exc:
            self.log.warning("swa_fetch.bad_reply", request_id=rid, holder=holder, error=exc.message)
            return None

    # ---- aborts, outputs, failures ---------------------------------------------------------
    async def _on_abort(self, msg: AbortRequest, ctx: Context) -> None:
        job = self.jobs.get(ctx.request_id)
        if job is None:
            return
        job.aborted = msg.reason or "client"
        if job.future is not None and not job.future.done():
            job.future.set_exception(Aborted(f"aborted: {msg.reason or 'client'}", request_id=job.request_id))
        self.log.info("request.aborted", request_id=job.request_id, reason=msg.reason or "client")

    @staticmethod
    def after_step(engine, outputs: list) -> dict:
        """On the engine thread, right after a step: the hand-off snapshot of every prompt it
        finished. Asked for later through `engine()`, the snapshot would wait for the next step
        (a whole prefill chunk) before the decode worker could start."""
        taken = {}
        for out in outputs:
            if out.prefilled and out.finish_reason is None:
                try:
                    taken[out.request_id] = engine.snapshot(out.request_id)
                except Exception as exc:   # noqa: BLE001 - reported to the request, not the thread
                    taken[out.request_id] = exc
        return taken

    def _on_outputs(self, outputs: list, taken: dict | None = None) -> None:
        self._engine_stats = self.engine_thread.engine.stats()
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if job is None or job.future is None or job.future.done():
                continue
            if out.prefilled or out.finish_reason is not None:
                job.future.set_result((out, (taken or {}).get(out.request_id)))

    def _on_engine_failure(self, exc: Exception) -> None:
        for job in self.jobs.values():
            if job.future is not None and not job.future.done():
                job.future.set_exception(EngineFailed(f"engine failure: {exc!r}", request_id=job.request_id))
