"""Workers <-> SWA location registry: who holds the sliding-window state for which prefix block.

SwaRegister and SwaUnregister are one-way notifications: the registry answers them only on error,
or with SwaAck when the sender asks (`ack`). SwaLookup -> SwaLookupReply.
The window itself is fetched with messages.handoff.SwaFetch sent to the registry, which forwards it
to the holder; the holder answers the requester directly.

Incarnations. Each registration names the registering process (`incarnation`, its
Service.incarnation): a new incarnation at an address retires everything the old one registered
there. A worker also sends an acknowledged SwaRegister without hashes every heartbeat interval
(the registration check): the registry's SwaAck says whether it already knew that process
(`known`); False (the registry restarted, or dropped the worker as silent) means: register every
window state you still hold again.
"""
from __future__ import annotations

from messages.registry import Message, register


@register(0x0501)
class SwaRegister(Message):
    prefix_hashes: list[bytes]      # hash of the prefix ending at a 128-token boundary
    holder: str                     # address of the worker that serves the state
    ttl_s: float = 180.0
    ack: bool = False               # answer with SwaAck (else only errors are answered)
    incarnation: str = ""           # the registering process; "" = unknown (tools, older senders)


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
    registry_incarnation: str = ""  # the registry process that answered
    known: bool = True              # False: the registry did not know the registering process
                                    # before this message (register what you hold again)
