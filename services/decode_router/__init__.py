"""Decode router: publishes the decode pool's load table; the score = alpha*kv_usage + beta*batch_size
(normalised) ranks its workers."""
from services.decode_router.core import DecodeCandidate, DecodePolicy, Scored, rank, score

__all__ = ["DecodeCandidate", "DecodePolicy", "Scored", "rank", "score"]
