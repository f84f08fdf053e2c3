"""Routers <-> workers: the routed work item. Workers report load in their Heartbeat
(messages.control.Load); routers answer with work or with an ErrorReply.

Prefill router -> decode router: DecodePick (request id in the envelope), answered with
DecodeChoice, or ErrorReply OVERLOADED when no decode worker can take the request.
Prefill router -> prefill worker: PrefillWork; the worker answers it (a reply on the same path,
same request id) with PrefillDone once the request state reached the decode instance, or with an
ErrorReply if it could not; the router forwards that error to the request's return_address.
"""
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


@register(0x0303)
class DecodePick(Message):
    """Prefill router -> decode router: choose the decode instance for this request."""

    prompt_tokens: int = 0
    max_tokens: int = 0


@register(0x0304)
class PrefillDone(Message):
    """Prefill worker -> prefill router, the reply to PrefillWork: the state was handed off."""

    hit_tokens: int = 0            # prefix tokens the worker actually loaded instead of computing
    computed_tokens: int = 0       # prompt tokens it prefilled
