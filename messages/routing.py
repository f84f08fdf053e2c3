"""Routers <-> workers: the routed work item. Workers report load in their Heartbeat
(messages.control.Load); routers answer with work or with an ErrorReply."""
from __future__ import annotations

from messages.generate import GenerateRequest
from messages.registry import Message, register


@register(0x0301)
class PrefillWork(Message):
    request: GenerateRequest
    hit_tokens: int = 0            # prefix length to load from the store instead of computing
    swa_holder: str = ""           # instance holding the SWA window at hit_tokens ("" = none)
    decode_address: str = ""       # decode worker chosen by the decode router


@register(0x0302)
class DecodeChoice(Message):
    """Decode router's answer: the instance that should receive the request state."""

    instance: str
    address: str
