"""Decode router: picks the decode instance by score = alpha*kv_usage + beta*batch_size (normalised)."""
from services.decode_router.core import DecodeCandidate, DecodePolicy, DecodeRouterCore, Scored, score

__all__ = ["DecodeCandidate", "DecodePolicy", "DecodeRouterCore", "Scored", "score"]
