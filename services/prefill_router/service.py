"""PrefillRouterService: the asyncio shell around PrefillRouterCore.

Gateways (their upstream is this router) send GenerateRequest, request id in the envelope. For each:
1. hit length: KvLookup(block hashes up to the hit cap) to the KV writer gives L1; SwaLookup(hashes
   of the blocks ending at the probe and one block before it) to the SWA registry says who holds
   the window at each; hit_length.hit_length decides: the probe with its holder, else one block
   less with the holder of that window (if any; without one a worker can use only the windows it
   holds itself until bounded replay exists). A lookup that is not configured, fails or times out
   counts as a miss: it never fails the request.
2. the core queues it in its length bucket (full: ErrorReply OVERLOADED to the gateway) and pumps.
3. for every hand-out: DecodePick to the decode router -> DecodeChoice (no decode router
   configured: decode_address ""), then PrefillWork(request, hit_tokens, swa_holder,
   decode_address) to the chosen prefill rank, with the request id and trace context.

The prefill worker contract. A worker of kind `worker_kind` registers with this router (Register;
`role` names its DP group, empty = a group of its own) and heartbeats its Load: in_flight = the
PrefillWork it holds, queued_tokens = uncached prompt tokens it has still to prefill, capacity =
most requests it takes at once (0 = no limit). On PrefillWork it loads `hit_tokens` of block KV
from the store; if `swa_holder` is set it fetches the SWA window at hit_tokens from that holder
(SwaFetch), else it starts at hit_tokens without one (bounded replay); it prefills the rest, hands
the state to `decode_address` (StateHandoff), and then answers the PrefillWork on the path it came
in (ctx.reply: same request id) with PrefillDone, or with an ErrorReply if it could not. It ignores
an ErrorReply answering its PrefillDone (this router may be draining). AbortRequest (request id in
the envelope) from this router cancels the request.

Failures reach the gateway as ErrorReply at the request's return_address: OVERLOADED (bucket queue
full or waited longer than max_queue_wait_s, or no decode worker), PEER_DEAD (the rank holding it
died), or whatever the worker or decode router answered. AbortRequest from the gateway removes a
waiting request, or is forwarded to the rank holding it and to its decode instance (remembered for
`route_memory` requests after prefill ends). A dead gateway's waiting requests are dropped and its
running ones aborted.
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass

from messages import ErrorReply
from messages.control import Load
from messages.errors import InvalidRequest, Overloaded, PeerDead, WireError
from messages.generate import AbortRequest, GenerateRequest
from messages.kv_store import KvLookup
from messages.routing import DecodePick, PrefillDone, PrefillWork
from messages.swa_registry import SwaLookup
from services.prefill_router.core import Outstanding, PrefillRouterCore, Queued, RankView
from services.prefill_router.hit_length import (BLOCK_TOKENS, hit_cap, hit_length, probe_hash_index,
                                                swa_probe)
from services.prefill_router.metrics import RouterCollector
from services.prefill_router.settings import PrefillRouterSettings
from services.runtime.config import ServiceConfig
from services.runtime.context import Context
from services.runtime.membership import Peer
from services.runtime.service import Handler, Service
from services.runtime.tracing import SpanContext


@dataclass(slots=True)
class Job:
    """The shell's part of a routed request (the core keeps it as the item's payload)."""

    request: GenerateRequest
    span: SpanContext
    swa_holder: str
    decode_address: str = ""


class PrefillRouterService(Service):
    kind = "prefill_router"

    def __init__(self, config: ServiceConfig):
        self.settings = PrefillRouterSettings.from_mapping(config.settings)
        self.core = PrefillRouterCore(self.settings.policy)
        self._routes: OrderedDict[str, str] = OrderedDict()   # finished prefill: request id -> decode address
        self._looking_up: set[str] = set()
        self._aborted_early: set[str] = set()
        self._ticker: asyncio.Task | None = None
        super().__init__(config)
        self.metrics.registry.register(RouterCollector(self.core, self.kind, config.instance))

    def handlers(self) -> dict[type, Handler]:
        return {GenerateRequest: self._on_generate, PrefillDone: self._on_done, ErrorReply: self._on_error,
                AbortRequest: self._on_abort}

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
        if rid in self._looking_up or self.core.is_queued(rid) or self.core.holder(rid):
            raise InvalidRequest(f"request {rid} is already routed here", request_id=rid)
        self._looking_up.add(rid)
        try:
            hit, holder = await self._hit_length(msg, rid, ctx.span)
        finally:
            self._looking_up.discard(rid)
        if rid in self._aborted_early:
            self._aborted_early.discard(rid)
            self.log.info("request.aborted_while_routing", request_id=rid)
            return
        item = self.core.submit(rid, len(msg.prompt_ids), hit, Job(msg, ctx.span, holder))
        self.log.info("request.queued", request_id=rid, bucket=item.bucket, prompt_tokens=item.prompt_tokens,
                      hit_tokens=hit, swa_holder=holder or None)
        self._pump()

    async def _on_done(self, msg: PrefillDone, ctx: Context) -> None:
        held = self._finish_from(ctx)
        if held is not None:
            self._remember_route(held)
            self.log.info("request.prefilled", request_id=held.request_id, rank=held.instance,
                          hit_tokens=msg.hit_tokens, computed_tokens=msg.computed_tokens)
            self._pump()

    async def _on_error(self, msg: ErrorReply, ctx: Context) -> None:
        held = self._finish_from(ctx)
        if held is None:
            self.log.warning("error.unrouted", request_id=ctx.request_id or None, sender=ctx.sender,
                             code=msg.code, error=msg.message)
            return
        self._fail(held.item, msg.to_exception(held.request_id))
        self._pump()

    async def _on_abort(self, msg: AbortRequest, ctx: Context) -> None:
        rid = ctx.request_id
        if rid in self._looking_up:
            self._aborted_early.add(rid)
            return
        found, where = self.core.cancel(rid), "queue"
        if isinstance(found, Outstanding):
            where = found.instance
            self._forward_abort(rid, found.item.payload, msg, found.address)
            self._pump()
        elif found is None:
            address = self._routes.pop(rid, "")
            where = address or "unknown"
            if address:
                self._send_quietly(address, msg, rid, ctx.span)
        self.log.info("request.aborted", request_id=rid, where=where)

    # ---- hit length --------------------------------------------------------------------
    async def _hit_length(self, msg: GenerateRequest, rid: str, span: SpanContext) -> tuple[int, str]:
        s = self.settings
        prompt_len = len(msg.prompt_ids)
        hashes = msg.block_hashes[: min(hit_cap(prompt_len) // BLOCK_TOKENS, s.max_lookup_blocks)]
        if not hashes or not s.kv_writer:
            return 0, ""
        try:
            reply = (await self.call(s.kv_writer, KvLookup(hashes, with_locations=False), request_id=rid, span=span,
                                     timeout=s.lookup_timeout_s)).message
            kv_hit = max(0, min(reply.hit_blocks, len(hashes))) * BLOCK_TOKENS
        except WireError as exc:
            self.log.warning("kv_lookup.failed", request_id=rid, code=exc.code.name, error=exc.message)
            return 0, ""
        probe = swa_probe(prompt_len, kv_hit)
        if not probe or not s.swa_registry:
            return hit_length(prompt_len, kv_hit, False), ""
        boundaries = [b for b in (probe, probe - BLOCK_TOKENS) if b > 0]   # the hit, and the one we back off to
        try:
            reply = (await self.call(s.swa_registry, SwaLookup([hashes[probe_hash_index(b)] for b in boundaries]),
                                     request_id=rid, span=span, timeout=s.lookup_timeout_s)).message
            holders = [*reply.holders[: len(boundaries)], "", ""]
        except WireError as exc:
            self.log.warning("swa_lookup.failed", request_id=rid, code=exc.code.name, error=exc.message)
            holders = ["", ""]
        if holders[0]:
            return probe, holders[0]
        return hit_length(prompt_len, kv_hit, False), holders[1]

    # ---- dispatch ----------------------------------------------------------------------
    def _pump(self) -> None:
        for held in self.core.update_ranks(self._rank_views()):
            self.log.warning("request.settled", request_id=held.request_id, rank=held.instance)
        for held in self.core.pump():
            self.in_background(self._dispatch(held), "prefill_router.dispatch_failed")

    def _rank_views(self) -> list[RankView]:
        return [RankView(p.instance, p.address, p.role or p.instance, p.load, p.accepts_work, p.last_seen)
                for p in self.members.alive(self.settings.worker_kind)]

    async def _dispatch(self, held: Outstanding) -> None:
        rid, job, s = held.request_id, held.item.payload, self.settings
        if s.decode_router:
            pick = DecodePick(held.item.prompt_tokens, job.request.sampling.max_tokens)
            try:
                choice = (await self.call(s.decode_router, pick, request_id=rid, span=job.span,
                                          timeout=s.decode_pick_timeout_s)).message
            except WireError as exc:
                if self.core.holder(rid) == held.instance:
                    self.core.cancel(rid)
                    self._fail(held.item, exc)
                    self._pump()
                return
            job.decode_address = choice.address
        if self.core.holder(rid) != held.instance:   # aborted, or its rank died, while we asked
            return
        work = PrefillWork(job.request, held.item.hit_tokens, job.swa_holder, job.decode_address)
        try:
            self.send(held.address, work, request_id=rid, span=job.span)
        except WireError as exc:
            self.core.cancel(rid)
            self._fail(held.item, exc)
            self._pump()
            return
        self.log.info("request.dispatched", request_id=rid, rank=held.instance, bucket=held.item.bucket,
                      hit_tokens=held.item.hit_tokens, decode=job.decode_address or None)

    def _finish_from(self, ctx: Context) -> Outstanding | None:
        """The request a rank answered for, if that rank holds it."""
        if not ctx.request_id or self.core.holder(ctx.request_id) != ctx.sender:
            return None
        return self.core.finish(ctx.request_id)

    # ---- failures, aborts, peers -------------------------------------------------------
    def _fail(self, item: Queued, error: WireError) -> None:
        job: Job = item.payload
        self.log.warning("request.failed", request_id=item.request_id, code=error.code.name, error=error.message)
        self._send_quietly(job.request.return_address, error.to_reply(), item.request_id, job.span)

    def _forward_abort(self, rid: str, job: Job, msg: AbortRequest, rank_address: str) -> None:
        self._send_quietly(rank_address, msg, rid, job.span)
        if job.decode_address:
            self._send_quietly(job.decode_address, msg, rid, job.span)

    def _send_quietly(self, address: str, message, rid: str, span: SpanContext) -> None:
        try:
            self.send(address, message, request_id=rid, span=span)
        except WireError as exc:
            self.log.warning("send.undeliverable", request_id=rid, to=address, code=exc.code.name)

    def _remember_route(self, held: Outstanding) -> None:
        address = held.item.payload.decode_address
        if address:
            self._routes[held.request_id] = address
            while len(self._routes) > self.settings.route_memory:
                self._routes.popitem(last=False)

    def on_peer_dead(self, peer: Peer) -> None:
        super().on_peer_dead(peer)
        if peer.kind == self.settings.worker_kind:
            for held in self.core.rank_dead(peer.instance):
                self._fail(held.item, PeerDead(f"prefill rank {peer.instance} died holding the request",
                                               request_id=held.request_id))
            self._pump()
            return
        gone = lambda item: item.payload.request.return_address == peer.address   # noqa: E731
        dropped = self.core.drop_queued(gone)
        for held in self.core.outstanding_where(gone):
            self.core.cancel(held.request_id)
            self._forward_abort(held.request_id, held.item.payload, AbortRequest("gateway_dead"), held.address)
        if dropped:
            self.log.warning("requests.dropped", peer=peer.instance, count=len(dropped))

    # ---- lifecycle ---------------------------------------------------------------------
    async def on_start(self) -> None:
        self._ticker = asyncio.get_running_loop().create_task(self._tick())
        s = self.settings
        self.log.info("prefill_router.started", buckets=list(s.policy.bucket_bounds), kv_writer=s.kv_writer or None,
                      swa_registry=s.swa_registry or None, decode_router=s.decode_router or None)

    async def on_stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
        self._ticker = None

    async def _tick(self) -> None:
        """Heartbeats change headroom and rounds end with no message to react to: look regularly."""
        while True:
            await asyncio.sleep(self.settings.pump_interval_s)
            try:
                for item in self.core.expire():
                    self._fail(item, Overloaded(f"waited more than {self.settings.policy.max_queue_wait_s} s "
                                                f"for a prefill rank (bucket {item.bucket})", request_id=item.request_id))
                self._pump()
            except Exception:   # a bug here must not stop routing for good: log it, try next tick
                self.log.exception("prefill_router.tick_failed")
