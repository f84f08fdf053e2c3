"""PrefillRouterSettings: the prefill router's options (ServiceConfig.settings), validated.

Addresses: kv_writer, swa_registry, decode_router ("" = not used: no block-KV hit / no SWA window /
no decode stage, decode_address ""). worker_kind: the kind prefill ranks register as. The routing
policy: bucket_bounds, alpha, beta, theta, round_s, queue_limit, queue_token_limit,
max_queue_wait_s, rank_token_budget, idle_settle_s (see core.RouterPolicy, buckets.QuotaModel).
Shell timings: lookup_timeout_s (KV / SWA lookups; a timeout counts as a miss),
decode_pick_timeout_s, pump_interval_s (how often heartbeat-driven headroom and round ends are
looked at), route_memory (finished prefills whose decode instance is kept for aborts),
max_lookup_blocks (the longest hash chain asked of the KV writer: 4096 blocks = 512 Ki tokens).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from services.prefill_router.buckets import DEFAULT_BOUNDS, QuotaModel
from services.prefill_router.core import RouterPolicy

_POLICY_KEYS = ("round_s", "queue_limit", "queue_token_limit", "max_queue_wait_s", "rank_token_budget",
                "idle_settle_s")
_QUOTA_KEYS = ("alpha", "beta", "theta")


@dataclass(slots=True, frozen=True)
class PrefillRouterSettings:
    policy: RouterPolicy
    kv_writer: str = ""
    swa_registry: str = ""
    decode_router: str = ""
    worker_kind: str = "prefill_worker"
    lookup_timeout_s: float = 1.0
    decode_pick_timeout_s: float = 5.0
    pump_interval_s: float = 0.02
    route_memory: int = 65536
    max_lookup_blocks: int = 4096      # hashes per KvLookup (the SWA registry's per-message default)

    def __post_init__(self) -> None:
        for name in ("lookup_timeout_s", "decode_pick_timeout_s", "pump_interval_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive finite number")
        if self.route_memory < 0 or self.max_lookup_blocks < 1:
            raise ValueError("route_memory must be >= 0 and max_lookup_blocks >= 1")
        if not self.worker_kind:
            raise ValueError("worker_kind must name the kind prefill ranks register as")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "PrefillRouterSettings":
        own = {"kv_writer", "swa_registry", "decode_router", "worker_kind", "lookup_timeout_s",
               "decode_pick_timeout_s", "pump_interval_s", "route_memory", "max_lookup_blocks"}
        unknown = set(values) - own - set(_POLICY_KEYS) - set(_QUOTA_KEYS) - {"bucket_bounds"}
        if unknown:
            raise ValueError(f"unknown prefill_router settings: {sorted(unknown)}")
        quota = QuotaModel(**{k: values[k] for k in _QUOTA_KEYS if k in values})
        policy = RouterPolicy(bucket_bounds=tuple(values.get("bucket_bounds", DEFAULT_BOUNDS)), quota=quota,
                              **{k: values[k] for k in _POLICY_KEYS if k in values})
        return cls(policy, **{k: v for k, v in values.items() if k in own})
