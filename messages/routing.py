"""Routers <-> workers: the routed work item, and the decode router's load table.

Workers report load in their Heartbeat (messages.control.Load); routers answer with work or with an
ErrorReply.

Prefill router -> decode router: DecodeTableQuery, answered with DecodeTable (every live decode
worker's last reported load and the decode score's weights). The prefill router asks it in the
background and picks the decode worker for each request locally: no round trip per request.
Prefill router -> prefill worker: PrefillWork; the worker answers it (a reply on the same path,
same request id) with PrefillDone once the request state reached the decode instance, or with an
ErrorReply if it could not; the router forwards that error to the request's return_address.
"""
from __future__ import annotations

from messages.control import PeerStatus
from messages.generate import GenerateRequest
from messages.registry import Message, register


@register(0x0301)
class PrefillWork(Message):
    request: GenerateRequest
    kv_hit_tokens: int = 0         # block-KV hit in the store, capped at L - 134 (the "probe"); the
                                   # worker settles L1 / L1-128 by where the SWA window is found
    decode_address: str = ""       # the decode worker that receives the state


# 0x0302 (DecodeChoice) and 0x0303 (DecodePick) are retired: the decode choice is made from DecodeTable.


@register(0x0304)
class PrefillDone(Message):
    """Prefill worker -> prefill router, the reply to PrefillWork: the state was handed off."""

    hit_tokens: int = 0            # prefix tokens the worker actually loaded instead of computing
    computed_tokens: int = 0       # prompt tokens it prefilled


@register(0x0305)
class DecodeTableQuery(Message):
    """Prefill router -> decode router: send me the current load table."""


@register(0x0306)
class DecodeTable(Message):
    """The decode router's view of its workers: every alive, registered decode worker with the load
    of its last heartbeat and that heartbeat's age, and the weights of DeepSeek's decode score
    (score = alpha * kv_usage + beta * batch_size, normalised; see services/decode_router/core.py)."""

    workers: list[PeerStatus] = []
    alpha: float = 1.0
    beta: float = 1.0
