"""PrefillRouterService: the asyncio shell around PrefillRouterCore. No request waits on a round
trip here: the hit and the decode worker are known in this process.

Gateways (their upstream is this router) send GenerateRequest, request id in the envelope. For each:
1. the block-KV hit: the request's hash chain (up to the L - 134 cap) is looked up in the KV
   store's index, read in this process from the store directory (`kv_store_dir`). The hit counts
   as the probe boundary (hit_length.swa_probe); the prefill worker settles L1 or L1 - 128 by where
   the window state is (one forwarded SwaFetch through the SWA registry). A store that cannot be
   read counts as a miss: it never fails the request.
2. the core queues it in its length bucket (full: ErrorReply OVERLOADED to the gateway) and pumps.
3. a hand-out needs a prefill rank with headroom and a decode worker with room (DecodeSlots, from
   the decode router's load table, refreshed in the background). Either missing: the request
   waits, bounded by the bucket queue and `max_queue_wait_s` (then OVERLOADED). Then
   PrefillWork(request, kv_hit_tokens, decode_address) goes to the rank.

The prefill worker contract. A worker of kind `worker_kind` registers with this router (Register;
`role` names its DP group, empty = a group of its own) and heartbeats its Load: in_flight = the
PrefillWork it holds, queued_tokens = uncached prompt tokens it has still to prefill, capacity =
most requests it takes at once (0 = no limit). On PrefillWork it loads the hit from the store and
the window state (its own, or fetched), prefills the rest, hands the state to `decode_address`
(StateHandoff), and answers the PrefillWork on the path it came in (same request id) with
PrefillDone, or with an ErrorReply if it could not. AbortRequest from this router cancels it.

Failures reach the gateway as ErrorReply at the request's return_address: OVERLOADED (bucket queue
full, or waited longer than max_queue_wait_s), PEER_DEAD (the rank holding it died), or whatever
the worker answered. AbortRequest from the gateway removes a waiting request or is forwarded to the
rank holding it; once the state has reached the decode worker, the gateway aborts there itself.
A dead gateway's waiting requests are dropped and its running ones aborted.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from messages import ErrorReply
from messages.control import Load, StatusQuery, StatusReply
from messages.errors import ErrorCode, InvalidRequest, Overloaded, PeerDead, WireError
from messages.generate import AbortRequest, GenerateRequest
from messages.routing import DecodeTableQuery, PrefillDone, PrefillWork
from services.prefill_router.core import Outstanding, PrefillRouterCore, Queued, RankView
from services.prefill_router.decode_slots import DecodeSlots, Reservation
from services.prefill_router.hit_length import BLOCK_TOKENS, hit_cap, swa_probe
from services.prefill_router.metrics import declare_metrics
from services.prefill_router.settings import PrefillRouterSettings
from services.runtime.config import ServiceConfig
from services.runtime.context import Context
from services.runtime.membership import Peer
from services.runtime.service import Handler, Service
from services.runtime.settings import parse_settings
from services.runtime.tracing import SpanContext


@dataclass(slots=True)
class Job:
    """The shell's part of a routed request (the core keeps it as the item's payload)."""

    request: GenerateRequest
    span: SpanContext
    sender: str
    received_at: float
    dispatched_at: float = 0.0
    buffers: list = field(default_factory=list)   # the request's image bytes, forwarded as they came


class PrefillRouterService(Service):
    kind = "prefill_router"
    # one request.summary per request, written when it leaves (done, failed, aborted), not per message
    streamed_types = (GenerateRequest, PrefillDone, ErrorReply, AbortRequest)

    def __init__(self, config: ServiceConfig):
        self.settings = parse_settings(PrefillRouterSettings, config.settings, self.kind)
        self.core = PrefillRouterCore(self.settings.policy)
        self.decode = DecodeSlots(self.settings.decode_table_stale_s)
        self.store = None   # kvstore StoreReader on kv_store_dir, opened in on_start
        self._loops: list[asyncio.Task] = []
        self._table_failing = False
        self._mismatched: list[str] = []   # decode workers last logged as serving another model
        super().__init__(config)
        declare_metrics(self.metrics, self.core)

    def handlers(self) -> dict[type, Handler]:
        return {GenerateRequest: self._on_generate, PrefillDone: self._on_done, ErrorReply: self._on_error,
                AbortRequest: self._on_abort, StatusQuery: self._on_status_query}

    async def _on_status_query(self, msg: StatusQuery, ctx: Context) -> StatusReply:
        """The shell's answer, naming the decode router: a gateway's /ready checks that pool too."""
        reply = await self._on_status(msg, ctx)
        reply.depends_on = [self.settings.decode_router] if self.settings.decode_router else []
        return reply

    def in_flight(self) -> int:
        return super().in_flight() + self.core.queued() + self.core.outstanding()

    def load(self) -> Load:
        return Load(queue_depth=self.core.queued(), in_flight=self.in_flight(),
                    queued_tokens=self.core.queued_tokens())

    # ---- handlers ----------------------------------------------------------------------
    async def _on_generate(self, msg: GenerateRequest, ctx: Context) -> None:
        rid = ctx.request_id
        if not rid or not msg.return_address or not msg.prompt_ids:
            raise InvalidRequest("GenerateRequest needs a request id, a return_address and prompt_ids",
                                 request_id=rid)
        if self.core.is_queued(rid) or self.core.holder(rid):
            raise InvalidRequest(f"request {rid} is already routed here", request_id=rid)
        for address in msg.avoid_workers:   # a resumed request: its decode worker died (the decode router
            self.decode.suspect_address(address)   # may list it for up to dead_after_s yet)
        probe = self._kv_probe(msg, rid)
        images = [ctx.envelope.frame(i) for i in range(len(ctx.envelope.buffers))]   # forwarded as they came
        item = self.core.submit(rid, len(msg.prompt_ids), probe,
                                Job(msg, ctx.span, ctx.sender, time.time(), buffers=images))
        self.log.info("request.queued", request_id=rid, bucket=item.bucket, prompt_tokens=item.prompt_tokens,
                      kv_hit_tokens=probe)
        self._pump()

    async def _on_done(self, msg: PrefillDone, ctx: Context) -> None:
        held = self._finish_from(ctx)
        if held is not None:
            self.decode.handed_off(held.request_id)
            self._summarize(held.item, "ok", rank=held.instance, hit_tokens=msg.hit_tokens,
                            computed_tokens=msg.computed_tokens)
            self._pump()

    async def _on_error(self, msg: ErrorReply, ctx: Context) -> None:
        held = self._finish_from(ctx)
        if held is None:
            self.log.warning("error.unrouted", request_id=ctx.request_id or None, sender=ctx.sender,
                             code=msg.code, error=msg.message)
            return
        self.decode.release(held.request_id)
        if msg.code == ErrorCode.PEER_DEAD and isinstance(held.admitted, Reservation):   # its decode worker
            self.decode.suspect(held.admitted.instance)
        self._fail(held.item, msg.to_exception(held.request_id))
        self._pump()

    async def _on_abort(self, msg: AbortRequest, ctx: Context) -> None:
        rid = ctx.request_id
        found = self.core.cancel(rid)
        self.decode.release(rid)
        if isinstance(found, Outstanding):
            self._send_quietly(found.address, msg, rid, found.item.payload.span)
            self._pump()
        if found is None:   # already handed off (the gateway aborts at the decode worker) or unknown
            self.log.info("request.abort_not_here", request_id=rid)
            return
        item = found.item if isinstance(found, Outstanding) else found
        self._summarize(item, f"aborted:{msg.reason or 'client'}",
                        rank=found.instance if isinstance(found, Outstanding) else None)

    # ---- the block-KV hit -----------------------------------------------------------------
    def _kv_probe(self, msg: GenerateRequest, rid: str) -> int:
        """The probe boundary: the store's hit on the chain, capped at L - 134 (0 = none)."""
        prompt_len = len(msg.prompt_ids)
        hashes = msg.block_hashes[: min(hit_cap(prompt_len) // BLOCK_TOKENS, self.settings.max_lookup_blocks)]
        if not hashes or self.store is None:
            return 0
        try:
            blocks = self.store.lookup(hashes)
        except Exception as exc:   # noqa: BLE001 - an unreadable store costs the hit, never the request
            self.log.warning("kv_lookup.failed", request_id=rid, error=repr(exc))
            return 0
        return swa_probe(prompt_len, min(blocks, len(hashes)) * BLOCK_TOKENS)

    # ---- dispatch ----------------------------------------------------------------------
    def _pump(self) -> None:
        for held in self.core.update_ranks(self._rank_views()):
            self.decode.release(held.request_id)
            self.log.warning("request.settled", request_id=held.request_id, rank=held.instance)
        admit = self._reserve_decode if self.settings.decode_router else None
        for held in self.core.pump(admit=admit):
            self._dispatch(held)

    def _reserve_decode(self, item: Queued) -> Reservation | None:
        return self.decode.reserve(item.request_id)

    def _rank_views(self) -> list[RankView]:
        return [RankView(p.instance, p.address, p.role or p.instance, p.load, p.accepts_work, p.last_seen)
                for p in self.members.alive(self.settings.worker_kind)]

    def _dispatch(self, held: Outstanding) -> None:
        rid, job = held.request_id, held.item.payload
        decode_address = held.admitted.address if isinstance(held.admitted, Reservation) else ""
        try:
            self.send(held.address, PrefillWork(job.request, held.item.hit_tokens, decode_address),
                      request_id=rid, span=job.span, buffers=job.buffers)
        except WireError as exc:
            self.core.cancel(rid)
            self.decode.release(rid)
            self._fail(held.item, exc)
            return
        job.dispatched_at = time.time()
        self.log.info("request.dispatched", request_id=rid, rank=held.instance, bucket=held.item.bucket,
                      kv_hit_tokens=held.item.hit_tokens, decode=decode_address or None)

    def _finish_from(self, ctx: Context) -> Outstanding | None:
        """The request a rank answered for, if that rank holds it."""
        if not ctx.request_id or self.core.holder(ctx.request_id) != ctx.sender:
            return None
        return self.core.finish(ctx.request_id)

    # ---- failures, peers -----------------------------------------------------------------
    def _fail(self, item: Queued, error: WireError) -> None:
        job: Job = item.payload
        self.log.warning("request.failed", request_id=item.request_id, code=error.code.name, error=error.message)
        self._send_quietly(job.request.return_address, error.to_reply(), item.request_id, job.span)
        self._summarize(item, error.code.name)

    def _summarize(self, item: Queued, outcome: str, **fields) -> None:
        """The request's one summary line here: queued (until dispatched) and prefill (until it left)."""
        job: Job = item.payload
        done = time.time()
        phases = {"queue_ms": round(((job.dispatched_at or done) - job.received_at) * 1e3, 3)}
        if job.dispatched_at:
            phases["prefill_ms"] = round((done - job.dispatched_at) * 1e3, 3)
        self.log.info("request.summary", request_id=item.request_id, trace_id=job.span.trace_id,
                      span_id=job.span.span_id, parent_span_id=job.span.parent_span_id or None,
                      type="GenerateRequest", sender=job.sender, start=job.received_at,
                      handle_ms=round((done - job.received_at) * 1e3, 3), phases=phases, bucket=item.bucket,
                      prompt_tokens=item.prompt_tokens, kv_hit_tokens=item.hit_tokens, outcome=outcome,
                      **{k: v for k, v in fields.items() if v is not None})

    def _send_quietly(self, address: str, message, rid: str, span: SpanContext) -> None:
        try:
            self.send(address, message, request_id=rid, span=span)
        except WireError as exc:
            self.log.warning("send.undeliverable", request_id=rid, to=address, code=exc.code.name)

    def on_peer_dead(self, peer: Peer) -> None:
        super().on_peer_dead(peer)
        if peer.kind == self.settings.worker_kind:
            for held in self.core.rank_dead(peer.instance):
                self.decode.release(held.request_id)
                self._fail(held.item, PeerDead(f"prefill rank {peer.instance} died holding the request",
                                               request_id=held.request_id))
            self._pump()
            return
        gone = lambda item: item.payload.request.return_address == peer.address   # noqa: E731
        dropped = self.core.drop_queued(gone)
        for held in self.core.outstanding_where(gone):
            self.core.cancel(held.request_id)
            self._summarize(held.item, "gateway_dead")
            self.decode.release(held.request_id)
            self._send_quietly(held.address, AbortRequest("gateway_dead"), held.request_id, held.item.payload.span)
        for item in dropped:
            self._summarize(item, "gateway_dead")
        if dropped:
            self.log.warning("requests.dropped", peer=peer.instance, count=len(dropped))

    # ---- lifecycle ---------------------------------------------------------------------
    async def on_start(self) -> None:
        s = self.settings
        if s.kv_store_dir:
            from kvstore.reader import StoreReader
            self.store = StoreReader(s.kv_store_dir, refresh_interval_s=0.05, read_threads=0,
                                     log=self.log.bind(component="kv_store_reader"))
        loop = asyncio.get_running_loop()
        self._loops = [loop.create_task(self._tick())]
        if s.decode_router:
            self._loops.append(loop.create_task(self._follow_decode_table()))
        self.log.info("prefill_router.started", buckets=list(s.policy.bucket_bounds), kv_store_dir=s.kv_store_dir or None,
                      decode_router=s.decode_router or None)

    async def on_stop(self) -> None:
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        self._loops = []
        if self.store is not None:
            self.store.close()

    async def _tick(self) -> None:
        """Heartbeats change headroom and rounds end with no message to react to: look regularly."""
        while True:
            await asyncio.sleep(self.settings.pump_interval_s)
            try:
                for item in self.core.expire():
                    self.decode.release(item.request_id)
                    self._fail(item, Overloaded(
                        f"waited more than {self.settings.policy.max_queue_wait_s:g} s for a prefill rank with "
                        f"headroom and a decode worker with room (bucket {item.bucket})", request_id=item.request_id))
                self._pump()
            except Exception:   # a bug here must not stop routing for good: log it, try next tick
                self.log.exception("prefill_router.tick_failed")

    async def _follow_decode_table(self) -> None:
        """Keep the decode router's load table fresh (off every request's path)."""
        s = self.settings
        while True:
            try:
                reply = await self.call(s.decode_router, DecodeTableQuery(), timeout=s.decode_table_stale_s)
                pool = self.members.model_id(s.worker_kind)
                self.decode.update(reply.message, model_id=pool)
                if self.decode.mismatched != self._mismatched:   # logged when the set changes, not every interval
                    self._mismatched = list(self.decode.mismatched)
                    if self._mismatched:
                        self.log.error("decode_pool.model_mismatch", workers=self._mismatched, model_id=pool,
                                       error="these decode workers serve another model than the prefill "
                                             "workers: no request is handed to them")
                if self._table_failing:
                    self._table_failing = False
                    self.log.info("decode_table.restored", workers=self.decode.workers())
                self._pump()
            except WireError as exc:
                if not self._table_failing:   # once per outage, not every interval
                    self._table_failing = True
                    self.log.warning("decode_table.unavailable", code=exc.code.name, error=exc.message)
            except Exception:   # a bug here must not stop the refresh for good
                self.log.exception("decode_table.failed")
            await asyncio.sleep(s.decode_table_interval_s)
