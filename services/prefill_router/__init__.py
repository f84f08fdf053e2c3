"""Prefill router: length buckets, engines per bucket by compute-quota share, pull under headroom."""
from services.prefill_router.buckets import DEFAULT_BOUNDS, QuotaModel, bucket_of, engine_targets, reassign
from services.prefill_router.core import Outstanding, PrefillRouterCore, Queued, RankView, RouterPolicy
from services.prefill_router.hit_length import hit_cap, hit_length, swa_probe

__all__ = ["DEFAULT_BOUNDS", "Outstanding", "PrefillRouterCore", "QuotaModel", "Queued", "RankView",
           "RouterPolicy", "bucket_of", "engine_targets", "hit_cap", "hit_length", "reassign", "swa_probe"]
