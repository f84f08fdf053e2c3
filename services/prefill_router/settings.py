"""PrefillRouterSettings: the prefill router's options (ServiceConfig.settings), validated.

kv_store_dir: the KV store's directory (the KV writer's root, read-only here): the block-KV hit of
each request is looked up in its index in this process ("" = no hits). decode_router: the decode
router's address ("" = no decode stage: decode_address ""). worker_kind: the kind prefill ranks
register as. The routing policy, given flat: bucket_bounds, alpha, beta, theta, round_s,
queue_limit, queue_token_limit, max_queue_wait_s, rank_token_budget, idle_settle_s (see
core.RouterPolicy, buckets.QuotaModel). Shell timings: pump_interval_s (how often heartbeat-driven
headroom, round ends and queue deadlines are looked at), decode_table_interval_s (how often the
decode router's load table is fetched), decode_table_stale_s (older than this, the table is not
used and requests wait). max_lookup_blocks: the longest hash chain looked up (4096 blocks = 512 Ki
tokens).
"""
from __future__ import annotations

from dataclasses import dataclass

from services.prefill_router.core import RouterPolicy
from services.runtime.settings import flat_field, require_positive


@dataclass(slots=True, frozen=True)
class PrefillRouterSettings:
    policy: RouterPolicy = flat_field(RouterPolicy)
    kv_store_dir: str = ""
    decode_router: str = ""
    worker_kind: str = "prefill_worker"
    pump_interval_s: float = 0.02
    decode_table_interval_s: float = 0.1
    decode_table_stale_s: float = 3.0
    max_lookup_blocks: int = 4096

    def __post_init__(self) -> None:
        require_positive(self, "pump_interval_s", "decode_table_interval_s", "decode_table_stale_s")
        if self.max_lookup_blocks < 1:
            raise ValueError("max_lookup_blocks must be >= 1")
        if not self.worker_kind:
            raise ValueError("worker_kind must name the kind prefill ranks register as")
