"""Decode workers / routers <-> the 3FS KV writer: persisting block pages and prefix lookup."""
from __future__ import annotations

from messages.common import TrafficClass
from messages.registry import Message, register


@register(0x0601)
class KvWritePages(Message):
    block_hashes: list[bytes]        # chain hashes of the blocks, in order
    page_frames: list[int]           # one buffer frame per block
    layout: str
    traffic_class: int = TrafficClass.CHATBOT


@register(0x0602)
class KvWriteAck(Message):
    written: int
    skipped: int = 0                 # already stored


@register(0x0603)
class KvLookup(Message):
    block_hashes: list[bytes]


@register(0x0604)
class KvLookupReply(Message):
    hit_blocks: int                  # longest prefix of the chain present in the store
    locations: list[str] = []        # where each hit block lives (segment:offset)
