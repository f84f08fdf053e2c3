"""DecodeRouterService: the asyncio shell around DecodeRouterCore.

Decode workers (kind `worker_kind`) register with this router and heartbeat their Load
(kv_usage = fraction of KV pages in use, batch_size = requests running, capacity = most requests
they take, 0 = no limit). The prefill router asks DecodePick (request id in the envelope) and gets
DecodeChoice(instance, address) of the lowest-scoring alive, RUNNING worker, or ErrorReply
OVERLOADED when none is alive (or all are at capacity).

Settings (ServiceConfig.settings): alpha, beta, pick_hold_s (see DecodePolicy), worker_kind
(default "decode_worker").
"""
from __future__ import annotations

from typing import Any, Mapping

from prometheus_client.core import CounterMetricFamily

from messages.routing import DecodeChoice, DecodePick
from services.decode_router.core import DecodeCandidate, DecodePolicy, DecodeRouterCore
from services.runtime.config import ServiceConfig
from services.runtime.context import Context
from services.runtime.membership import Peer
from services.runtime.service import Handler, Service


def _settings(values: Mapping[str, Any]) -> tuple[DecodePolicy, str]:
    policy_keys = {"alpha", "beta", "pick_hold_s"}
    unknown = set(values) - policy_keys - {"worker_kind"}
    if unknown:
        raise ValueError(f"unknown decode_router settings: {sorted(unknown)}")
    worker_kind = values.get("worker_kind", "decode_worker")
    if not worker_kind or not isinstance(worker_kind, str):
        raise ValueError("worker_kind must name the kind decode workers register as")
    return DecodePolicy(**{k: v for k, v in values.items() if k in policy_keys}), worker_kind


class DecodeRouterService(Service):
    kind = "decode_router"

    def __init__(self, config: ServiceConfig):
        policy, self.worker_kind = _settings(config.settings)
        self.core = DecodeRouterCore(policy)
        super().__init__(config)
        self.metrics.registry.register(_Collector(self.core, self.kind, config.instance))

    def handlers(self) -> dict[type, Handler]:
        return {DecodePick: self._on_pick}

    def candidates(self) -> list[DecodeCandidate]:
        return [DecodeCandidate(p.instance, p.address, p.load, p.accepts_work)
                for p in self.members.alive(self.worker_kind)]

    async def _on_pick(self, msg: DecodePick, ctx: Context) -> DecodeChoice:
        chosen = self.core.pick(self.candidates())
        self.log.debug("decode.picked", request_id=ctx.request_id, instance=chosen.instance,
                       prompt_tokens=msg.prompt_tokens)
        return DecodeChoice(chosen.instance, chosen.address)

    def on_peer_dead(self, peer: Peer) -> None:
        super().on_peer_dead(peer)
        self.core.forget(peer.instance)

    async def on_start(self) -> None:
        self.log.info("decode_router.started", alpha=self.core.policy.alpha, beta=self.core.policy.beta,
                      worker_kind=self.worker_kind)


class _Collector:
    def __init__(self, core: DecodeRouterCore, kind: str, instance: str):
        self.core = core
        self.labels = [kind, instance]

    def collect(self):
        for name, doc in (("picks", "Decode instances chosen"),
                          ("refused", "DecodePick refused: no eligible decode worker")):
            family = CounterMetricFamily(f"epd_decode_router_{name}", doc, labels=["kind", "instance"])
            family.add_metric(self.labels, getattr(self.core.stats, name))
            yield family
