"""SwaRegistryService: the asyncio shell around SwaRegistry.

Workers send SwaRegister / SwaUnregister (answered with SwaAck(count)) and SwaLookup (answered
with SwaLookupReply, one holder or "" per hash). A background task removes expired entries; a
registered peer that stops heartbeating loses all entries held under its address.

Settings (ServiceConfig.settings): default_ttl_s, max_ttl_s, max_entries, max_hashes_per_message
(see RegistryLimits), expire_interval_s (how often expiry runs) and expire_batch (entries removed
before yielding to the event loop).
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from messages.swa_registry import SwaAck, SwaLookup, SwaLookupReply, SwaRegister, SwaUnregister
from services.runtime.config import ServiceConfig
from services.runtime.context import Context
from services.runtime.membership import Peer
from services.runtime.service import Handler, Service
from services.swa_registry.core import RegistryLimits, SwaRegistry


@dataclass(slots=True, frozen=True)
class SwaRegistrySettings:
    limits: RegistryLimits
    expire_interval_s: float = 1.0
    expire_batch: int = 2_000     # ~10 ms of work between yields

    def __post_init__(self) -> None:
        if not (math.isfinite(self.expire_interval_s) and self.expire_interval_s > 0):
            raise ValueError("expire_interval_s must be a positive finite number")
        if self.expire_batch < 1:
            raise ValueError("expire_batch must be >= 1")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "SwaRegistrySettings":
        limit_keys = {f.name for f in dataclasses.fields(RegistryLimits)}
        own_keys = {"expire_interval_s", "expire_batch"}
        unknown = set(values) - limit_keys - own_keys
        if unknown:
            raise ValueError(f"unknown swa_registry settings: {sorted(unknown)}")
        limits = RegistryLimits(**{k: v for k, v in values.items() if k in limit_keys})
        return cls(limits, **{k: v for k, v in values.items() if k in own_keys})


class SwaRegistryService(Service):
    kind = "swa_registry"

    def __init__(self, config: ServiceConfig):
        self.settings = SwaRegistrySettings.from_mapping(config.settings)
        self.registry = SwaRegistry(self.settings.limits)
        self._expiry: asyncio.Task | None = None
        super().__init__(config)
        self.metrics.registry.register(_RegistryCollector(self.registry, self.kind, config.instance))

    def handlers(self) -> dict[type, Handler]:
        return {SwaRegister: self.on_register, SwaLookup: self.on_lookup, SwaUnregister: self.on_unregister}

    # ---- handlers ----------------------------------------------------------------------
    async def on_register(self, msg: SwaRegister, ctx: Context) -> SwaAck:
        return SwaAck(self.registry.register(msg.prefix_hashes, msg.holder, msg.ttl_s))

    async def on_lookup(self, msg: SwaLookup, ctx: Context) -> SwaLookupReply:
        return SwaLookupReply(self.registry.lookup(msg.prefix_hashes))

    async def on_unregister(self, msg: SwaUnregister, ctx: Context) -> SwaAck:
        return SwaAck(self.registry.unregister(msg.prefix_hashes, msg.holder))

    # ---- lifecycle ---------------------------------------------------------------------
    async def on_start(self) -> None:
        self._expiry = asyncio.get_running_loop().create_task(self._expire_entries())
        self.log.info("swa_registry.started", max_entries=self.settings.limits.max_entries,
                      max_ttl_s=self.settings.limits.max_ttl_s,
                      expire_interval_s=self.settings.expire_interval_s)

    async def on_stop(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            await asyncio.gather(self._expiry, return_exceptions=True)
            self._expiry = None

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


class _RegistryCollector:
    """Prometheus view of the registry's counts, read at scrape time (nothing on the hot path)."""

    _COUNTERS = (
        ("registrations", "Hashes registered (new or replaced)"),
        ("lookups", "Hashes looked up"),
        ("hits", "Looked-up hashes that had a live holder"),
        ("misses", "Looked-up hashes with no live holder"),
        ("evictions", "Entries evicted because the registry was full"),
        ("expirations", "Entries removed because their TTL ran out"),
        ("unregistrations", "Entries removed by their holder"),
        ("dropped", "Entries removed because their holder died"),
    )

    def __init__(self, registry: SwaRegistry, kind: str, instance: str):
        self.registry = registry
        self.label_names = ["kind", "instance"]
        self.label_values = [kind, instance]

    def collect(self):
        entries = GaugeMetricFamily("epd_swa_entries", "Live entries in the SWA registry",
                                    labels=self.label_names)
        entries.add_metric(self.label_values, len(self.registry))
        yield entries
        stats = self.registry.stats
        for name, doc in self._COUNTERS:
            family = CounterMetricFamily(f"epd_swa_{name}", doc, labels=self.label_names)
            family.add_metric(self.label_values, getattr(stats, name))
            yield family
