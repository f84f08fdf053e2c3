"""SwaRegistryService: the asyncio shell around SwaRegistry.

Workers send SwaRegister / SwaUnregister (one-way: answered with SwaAck(count) only when they ask
for it, or with an ErrorReply) and SwaLookup (answered with SwaLookupReply, one holder or "" per
hash). SwaFetch (prefill workers: the window at the first of these boundaries) is forwarded to the
latest live holder of the first boundary that has one, other than the requester, which answers the
requester directly as the reply to its call; no holder: SwaState(found=False) from here.

Restarts. Registrations and fetches name the sending process (incarnation): a new process at an
address retires its predecessor's entries at once (core.py, holders.py), so a restarted worker is
neither asked for windows it never had nor mistaken for their holder when it asks itself. Workers
check in every heartbeat interval (an acknowledged SwaRegister without hashes); one silent for
longer than this registry's dead_after_s loses its entries (within another half interval). The ack
carries this process's incarnation and `known`: False after this registry restarted (it knows
nobody), so every worker registers the windows it still holds again and the state rebuilds itself.
Background tasks remove expired entries and silent holders; a registered peer that stops
heartbeating loses all entries held under its address.

Settings (ServiceConfig.settings): default_ttl_s, max_ttl_s, max_entries, max_hashes_per_message
(see RegistryLimits), expire_interval_s (how often expiry runs) and expire_batch (entries removed
before yielding to the event loop).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from messages.errors import InvalidRequest, WireError
from messages.handoff import SwaFetch, SwaState
from messages.swa_registry import SwaAck, SwaLookup, SwaLookupReply, SwaRegister, SwaUnregister
from services.runtime.config import ServiceConfig
from services.runtime.context import Context
from services.runtime.membership import Peer
from services.runtime.service import Handler, Service
from services.runtime.settings import flat_field, parse_settings, require_positive
from services.swa_registry.core import RegistryLimits, SwaRegistry
from services.swa_registry.holders import CheckIn
from services.swa_registry.metrics import declare_metrics


@dataclass(slots=True, frozen=True)
class SwaRegistrySettings:
    limits: RegistryLimits = flat_field(RegistryLimits)
    expire_interval_s: float = 1.0
    expire_batch: int = 2_000     # ~10 ms of work between yields

    def __post_init__(self) -> None:
        require_positive(self, "expire_interval_s")
        if self.expire_batch < 1:
            raise ValueError("expire_batch must be >= 1")


class SwaRegistryService(Service):
    kind = "swa_registry"

    def __init__(self, config: ServiceConfig):
        self.settings = parse_settings(SwaRegistrySettings, config.settings, self.kind)
        self.registry = SwaRegistry(self.settings.limits, holder_timeout_s=config.dead_after_s)
        self._expiry: asyncio.Task | None = None
        self._holder_expiry: asyncio.Task | None = None
        super().__init__(config)
        declare_metrics(self.metrics, self.registry)

    def handlers(self) -> dict[type, Handler]:
        return {SwaRegister: self.on_register, SwaLookup: self.on_lookup, SwaUnregister: self.on_unregister,
                SwaFetch: self.on_fetch}

    # ---- handlers ----------------------------------------------------------------------
    async def on_register(self, msg: SwaRegister, ctx: Context) -> SwaAck | None:
        # acknowledged: the sender learns whether this registry knew it, and re-registers all if not
        count, seen = self.registry.registration(msg.prefix_hashes, msg.holder, msg.ttl_s, msg.incarnation,
                                                 answered=msg.ack)
        if seen in (CheckIn.UNKNOWN, CheckIn.REPLACED):
            self.log.info("swa_registry.holder_checked_in", holder=msg.holder, seen=seen.value,
                          incarnation=msg.incarnation)
        if not msg.ack:
            return None
        return SwaAck(count, self.incarnation, known=seen not in (CheckIn.UNKNOWN, CheckIn.REPLACED))

    async def on_lookup(self, msg: SwaLookup, ctx: Context) -> SwaLookupReply:
        return SwaLookupReply(self.registry.lookup(msg.prefix_hashes))

    async def on_unregister(self, msg: SwaUnregister, ctx: Context) -> SwaAck | None:
        count = self.registry.unregister(msg.prefix_hashes, msg.holder)
        return SwaAck(count, self.incarnation) if msg.ack else None

    async def on_fetch(self, msg: SwaFetch, ctx: Context) -> SwaState | None:
        if not msg.reply_to:
            raise InvalidRequest("SwaFetch to the registry needs reply_to (the requester's address)",
                                 request_id=ctx.request_id)
        known = self.registry.tracked.incarnation(msg.reply_to)
        if msg.requester_incarnation and known and known != msg.requester_incarnation:
            # a restarted requester: its predecessor's entries must not pass for its own windows
            self.registry.check_in(msg.reply_to, msg.requester_incarnation)
        holder, hashes = self.registry.choose(msg.prefix_hashes, msg.reply_to)
        if not holder:
            return SwaState(found=False)
        try:
            self.send(holder, SwaFetch(hashes, msg.reply_to, ctx.envelope.header.msg_id),
                      request_id=ctx.request_id, span=ctx.span)
        except WireError as exc:
            self.log.warning("swa_fetch.unforwardable", holder=holder, code=exc.code.name)
            return SwaState(found=False)
        return None

    # ---- lifecycle ---------------------------------------------------------------------
    async def on_start(self) -> None:
        loop = asyncio.get_running_loop()
        self._expiry = loop.create_task(self._expire_entries())
        self._holder_expiry = loop.create_task(self._expire_holders())
        self.log.info("swa_registry.started", max_entries=self.settings.limits.max_entries,
                      max_ttl_s=self.settings.limits.max_ttl_s,
                      expire_interval_s=self.settings.expire_interval_s)

    async def on_stop(self) -> None:
        tasks = [t for t in (self._expiry, self._holder_expiry) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._expiry = self._holder_expiry = None

    def on_peer_dead(self, peer: Peer) -> None:
        super().on_peer_dead(peer)
        dropped = self.registry.drop_holder(peer.address)
        self.log.warning("swa_registry.holder_dropped", peer=peer.instance, address=peer.address,
                         entries=dropped)

    async def _expire_entries(self) -> None:
        batch = self.settings.expire_batch
        while True:
            await asyncio.sleep(self.settings.expire_interval_s)
            try:
                while self.registry.expire(limit=batch) == batch:
                    await asyncio.sleep(0)   # a large backlog never blocks the handlers
            except Exception:   # a bug here must not end expiry for good: log it, try next tick
                self.log.exception("swa_registry.expire_failed")

    async def _expire_holders(self) -> None:
        """Drop the entries of holders silent past dead_after_s (checked as often as peers are, and
        at least four times per dead_after_s: a longer gap is taken for this process's own stall)."""
        while True:
            await asyncio.sleep(min(self.config.heartbeat_s / 2, self.config.dead_after_s / 4))
            try:
                for holder in self.registry.expire_holders():
                    self.log.warning("swa_registry.holder_silent", holder=holder)
            except Exception:   # a bug here must not end holder expiry for good
                self.log.exception("swa_registry.holder_expiry_failed")
