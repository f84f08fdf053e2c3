"""Workers <-> SWA location registry: who holds the sliding-window state for which prefix block.

SwaRegister and SwaUnregister are one-way notifications: the registry answers them only on error,
or with SwaAck when the sender asks (`ack`, for tests and tools). SwaLookup -> SwaLookupReply.
The window itself is fetched with messages.handoff.SwaFetch sent to the registry, which forwards it
to the holder; the holder answers the requester directly.
"""
from __future__ import annotations

from messages.registry import Message, register


@register(0x0501)
class SwaRegister(Message):
    prefix_hashes: list[bytes]      # hash of the prefix ending at a 128-token boundary
    holder: str                     # address of the worker that serves the state
    ttl_s: float = 180.0
    ack: bool = False               # answer with SwaAck (else only errors are answered)


@register(0x0502)
class SwaLookup(Message):
    prefix_hashes: list[bytes]


@register(0x0503)
class SwaLookupReply(Message):
    holders: list[str]              # one per asked hash, "" where none is registered


@register(0x0504)
class SwaUnregister(Message):
    prefix_hashes: list[bytes]
    holder: str
    ack: bool = False


@register(0x0505)
class SwaAck(Message):
    count: int = 0
