"""The `prefill` worker: prefills routed requests and hands their state to a decode worker.

It registers with the prefill router (config.upstream) as kind "prefill_worker" and heartbeats its
Load: in_flight = PrefillWork it holds, queued_tokens = uncached prompt tokens it has still to
prefill, capacity = most requests it takes at once (settings.capacity, default max_num_seqs).

PrefillWork (request id in the envelope) -> the reply on the same path, PrefillDone or ErrorReply:
1. the hit (prefix_load.py): `kv_hit_tokens` (the router's probe, L1 capped at L - 134) of block
   KV come from the KV store; the window state comes from this engine if it holds it, else from
   the SWA registry in one forwarded call (the holder answers here directly). DeepSeek's rule:
   the window at L1 gives L1, else the window at L1 - 128 gives L1 - 128, else what this engine
   holds. A store or holder that fails only shortens the hit: it never fails the request.
   A constrained request's grammar is fetched from its compiler meanwhile (grammar.py).
2. engine.admit(request, the prefix read, prefill_only=True): the import and the request in one
   engine-thread call; the first token comes out and the state is held.
3. the first token goes to the gateway (`return_address`) at once, numbered (first_index 0) and
   naming no worker: the decode worker sends it again with its own address on its first chunk, so
   the gateway shows it once and learns who streams the request from the decode worker.
4. snapshot -> StateHandoff (buffers as frames, generated_ids = the first token, with its logprobs
   when asked) to `decode_address` with call(), awaiting StateAccepted (a decode worker that stops
   answering status probes meanwhile fails it as PEER_DEAD within ~dead_after_s) -> release ->
   PrefillDone(hit_tokens = prompt tokens the engine took from its prefix cache, computed_tokens =
   the rest). A first token that already finishes the request (EOS, max_tokens=1) goes to the
   gateway from here as the last chunk; nothing is handed off.
AbortRequest from the router cancels the request (an ErrorReply ABORTED answers the PrefillWork,
which the router ignores by then); one that arrives during the hand-off goes on to the decode worker.
The boundary states the prefill saved are registered with the SWA registry and served on SwaFetch.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from messages.control import Load
from messages.errors import ErrorCode, InvalidRequest, PeerDead, RemoteError, WireError
from messages.generate import AbortRequest
from messages.handoff import StateHandoff
from messages.prefix import BLOCK_TOKENS, block_hashes
from messages.routing import PrefillDone, PrefillWork
from messages.vision import VisionEncoded, VisionFailed
from services.runtime import liveness
from services.runtime.context import Context
from services.runtime.tracing import SpanContext
from services.workers.chunks import chunk_from, logprob_fields
from services.workers.engine_worker import EngineWorker
from services.workers.hash_check import HashChainCheck
from services.workers.images import first_computed
from services.workers.prefix_load import PrefixLoader
from services.workers.tensors import to_frame


class Aborted(WireError):
    code = ErrorCode.ABORTED


class EngineFailed(WireError):
    code = ErrorCode.INTERNAL


@dataclass(slots=True)
class Job:
    request_id: str
    uncached_tokens: int
    span: SpanContext
    decode_address: str
    future: asyncio.Future | None = None
    prefilled: bool = False
    handing_off: bool = False
    aborted: str = ""


class PrefillWorker(EngineWorker):
    kind = "prefill_worker"
    # the PrefillWork's summary line is the request's one line here
    streamed_types = (AbortRequest, VisionEncoded, VisionFailed)
    continuation_types = (VisionEncoded, VisionFailed)   # a draining worker still finishes the prefills it holds

    def __init__(self, config):
        super().__init__(config)
        self.jobs: dict[str, Job] = {}
        self.prefix = PrefixLoader(self)
        self.hash_check = HashChainCheck()

    def handlers(self):
        return {**self.base_handlers(), PrefillWork: self._on_work, AbortRequest: self._on_abort}

    async def on_start(self) -> None:
        await super().on_start()
        self.prefix.open()

    async def on_stop(self) -> None:
        await super().on_stop()
        self.prefix.close()

    def in_flight(self) -> int:
        return super().in_flight() + len(self.jobs)

    def load(self) -> Load:
        load = super().load()
        load.in_flight = len(self.jobs)
        load.queued_tokens = sum(j.uncached_tokens for j in self.jobs.values() if not j.prefilled)
        return load

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
        self.hash_check.check(self.log, self.model_id, request.prompt_ids, request.block_hashes, request.images)
        prompt_len = len(request.prompt_ids)
        job = self.jobs[rid] = Job(rid, prompt_len - msg.kv_hit_tokens, ctx.span, msg.decode_address)
        started = time.time()
        added = False
        fetch = None   # a constrained request's grammar comes while its prefix loads (grammar.py)
        if request.grammar is not None:
            fetch = asyncio.ensure_future(self.grammars.fetch(request.grammar, rid, ctx.span))
        images = self.images.images_of(request, ctx.envelope)   # their embeddings come meanwhile too
        encoding = self.images.start(rid, images, request.vision_groups, first_computed(msg.kv_hit_tokens), ctx.span)
        try:
            plan = await self.prefix.plan(request, msg.kv_hit_tokens, rid, ctx.span)
            job.uncached_tokens = prompt_len - plan.usable
            grammar_text, grammar = "", None
            if fetch is not None:
                grammar_text = await fetch
                grammar = await self.grammars.state(request.grammar, grammar_text, rid)
            image_rows = []
            if images:
                image_rows = await encoding if encoding is not None else [None] * len(images)
            if job.aborted:
                raise Aborted(f"aborted: {job.aborted}", request_id=rid)
            job.future = asyncio.get_running_loop().create_future()
            engine_request = EngineRequest(rid, list(request.prompt_ids), request.sampling,
                                           request.arrival_time or time.time(), request.exact_prefix, grammar=grammar,
                                           images=list(request.images), image_embeds=image_rows)
            # images the hit was expected to cover but a shorter one leaves to compute: not added yet
            ready = (lambda usable: all(rows is not None or image.end <= first_computed(usable)
                                        for image, rows in zip(images, image_rows))) if images else None
            admitted = await self._admit(engine_request, plan.prefix, ready)
            added = admitted.added
            usable = self.prefix.report(plan, admitted, rid)
            job.uncached_tokens = prompt_len - usable
            if not added:
                engine_request.image_embeds = await self.images.more(rid, images, image_rows, request.vision_groups,
                                                                     first_computed(usable), ctx.span)
                if job.aborted:
                    raise Aborted(f"aborted: {job.aborted}", request_id=rid)
                await self._admit(engine_request, None, None)
                added = True
            out, taken = await job.future
            job.prefilled = True
            prefilled_at = time.time()
            if out.finish_reason is not None:   # the first token ended it: nothing to hand off
                added = False
                self.send(request.return_address, self._last_chunk(out), request_id=rid, span=ctx.span)
            else:
                self._send_first_token(request.return_address, rid, ctx.span, out)
                job.handing_off = True
                await self._hand_off(msg, rid, ctx.span, out, taken, grammar_text, image_rows)
                added = False
            self.in_background(self._advertise_prompt_states(request, rid, ctx.span), "swa_advertise.failed",
                               level="warning")
            hit = out.num_cached_tokens
            self.log.info("request.prefilled", request_id=rid, prompt_tokens=prompt_len, hit_tokens=hit,
                          kv_hit_tokens=msg.kv_hit_tokens, decode=msg.decode_address,
                          prefill_ms=round((prefilled_at - started) * 1e3, 3),
                          handoff_ms=round((time.time() - prefilled_at) * 1e3, 3))
            return PrefillDone(hit_tokens=hit, computed_tokens=prompt_len - hit)
        finally:
            if encoding is not None and not encoding.done():
                self.images.cancel(rid)
                encoding.cancel()
            if fetch is not None:
                fetch.cancel()
                if fetch.done() and not fetch.cancelled():
                    fetch.exception()   # the prefix load failed first: its error stands, this one is read
            self.jobs.pop(rid, None)
            if added:   # failed or aborted after the engine took it: free its state
                await self.engine(lambda engine, r: engine.abort(r), rid)
            await self.refresh_stats()

    async def _admit(self, engine_request, prefix, ready):
        try:
            return await self.engine(lambda engine: engine.admit(engine_request, prefix, True, ready))
        except ValueError as exc:
            raise InvalidRequest(str(exc), request_id=engine_request.request_id) from None

    def _last_chunk(self, out):
        chunk = chunk_from(out, len(out.new_token_ids), first_index=0)
        chunk.worker, chunk.worker_incarnation = self.config.advertise, self.incarnation
        return chunk

    def _send_first_token(self, gateway: str, rid: str, span: SpanContext, out) -> None:
        """The first token to the gateway before the hand-off: it names no worker (the decode
        worker streams the request and says so); lost, it still comes from the decode worker."""
        try:
            self.send(gateway, chunk_from(out, len(out.new_token_ids), first_index=0), request_id=rid, span=span)
        except WireError as exc:
            self.log.warning("first_token.undeliverable", request_id=rid, code=exc.code.name)

    async def _advertise_prompt_states(self, request, rid: str, span: SpanContext) -> None:
        """Register the window states this prefill saved at the prompt's block boundaries (the
        decode worker persists the pages; these states exist only here)."""
        if not self.settings.swa_registry or len(request.prompt_ids) < BLOCK_TOKENS:
            return
        hashes = list(request.block_hashes)
        if len(hashes) != len(request.prompt_ids) // BLOCK_TOKENS:
            hashes = block_hashes(self.model_id, list(request.prompt_ids), images=request.images)
        held = await self.engine(lambda engine: [h for h in hashes if h in engine.kv.boundaries])
        self.persister.advertise(held, rid, span)

    async def _hand_off(self, msg: PrefillWork, rid: str, span: SpanContext, out, taken, grammar: str,
                        image_rows: list) -> None:
        """`taken`: the snapshot `after_step` took right after the prompt's step (or the error it
        raised); None only if the step's outputs came without one (then ask the engine now).
        `image_rows`: the rows the prefill had per image (None where it had none)."""
        if isinstance(taken, Exception):
            raise EngineFailed(f"snapshot for the hand-off failed: {taken!r}", request_id=rid)
        if taken is None:
            taken = await self.engine(lambda engine, r: engine.snapshot(r), rid)
        snapshot, buffers = taken
        logprobs, top_logprobs = logprob_fields(out)
        frames = [to_frame(b) for b in buffers]
        image_frames = []
        for image, rows in zip(msg.request.images, image_rows):
            keep = rows is not None and image.end > first_computed(len(msg.request.prompt_ids))
            image_frames.append(len(frames) if keep else -1)
            if keep:
                frames.append(to_frame(rows))
        handoff = StateHandoff(msg.request, snapshot, list(range(len(buffers))), list(out.new_token_ids),
                               logprobs, top_logprobs, grammar, image_frames)
        try:
            reply = await self._call_while_alive(msg.decode_address, handoff, rid, span, frames)
        except BaseException as exc:
            if not isinstance(exc, RemoteError):   # no answer: it may still arrive there, so abort it there
                self._abort_at_decode(msg.decode_address, rid, span, "handoff_failed")
            await self.engine(lambda engine, r: engine.abort(r), rid)
            raise
        await self.engine(lambda engine, r: engine.release(r), rid)
        accepted = reply.message
        if not getattr(accepted, "accepted", False):
            raise InvalidRequest(f"decode worker refused the state: {getattr(accepted, 'reason', '')}",
                                 request_id=rid)

    async def _call_while_alive(self, address: str, handoff: StateHandoff, rid: str, span: SpanContext, frames):
        """The hand-off call, given up as PEER_DEAD as soon as the decode worker stops answering
        status probes (about dead_after_s), not after handoff_timeout_s: the gateway then resumes
        the request elsewhere."""
        call = asyncio.ensure_future(self.call(address, handoff, request_id=rid, span=span, buffers=frames,
                                               timeout=self.settings.handoff_timeout_s))
        dead = asyncio.ensure_future(liveness.until_dead(self, address))
        try:
            await asyncio.wait({call, dead}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:   # this handler was cancelled (an abort, the worker stopping)
            call.cancel()
            raise
        finally:
            dead.cancel()
        if not call.done():
            call.cancel()
            raise PeerDead(f"decode worker {address} died during the hand-off", request_id=rid)
        return call.result()

    def _abort_at_decode(self, address: str, rid: str, span: SpanContext, reason: str) -> None:
        try:
            self.send(address, AbortRequest(reason), request_id=rid, span=span)
        except WireError:
            pass

    # ---- aborts, outputs, failures ---------------------------------------------------------
    async def _on_abort(self, msg: AbortRequest, ctx: Context) -> None:
        job = self.jobs.get(ctx.request_id)
        if job is None:
            return
        reason = msg.reason or "client"
        job.aborted = reason
        self.images.cancel(job.request_id)   # a wait for its image embeddings ends now
        if job.handing_off:   # the state is on its way: the decode worker frees it when it lands
            self._abort_at_decode(job.decode_address, job.request_id, job.span, reason)
        elif job.future is not None and not job.future.done():
            job.future.set_exception(Aborted(f"aborted: {reason}", request_id=job.request_id))
        self.log.info("request.aborted", request_id=job.request_id, reason=reason)

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

    def _on_outputs(self, outputs: list, after: object = None) -> None:
        self.stats_after_step()
        taken = after or {}
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if job is None or job.future is None or job.future.done():
                continue
            if out.prefilled or out.finish_reason is not None:
                job.future.set_result((out, taken.get(out.request_id)))

    def _on_engine_failure(self, exc: Exception) -> None:
        for job in self.jobs.values():
            if job.future is not None and not job.future.done():
                job.future.set_exception(EngineFailed(f"engine failure: {exc!r}", request_id=job.request_id))
