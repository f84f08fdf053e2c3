"""Decode workers / routers / prefill workers <-> the 3FS KV writer: persisting block pages, prefix
lookup and reading pages back.

Decode workers send each completed 128-token block (`KvWritePages`: its chain hash and its page as
one buffer frame); the writer stores those it does not already hold. A write is a one-way
notification: the writer answers only a failure (ErrorReply), or a `KvWriteAck` where the sender
asked for one (`ack=True`: tests, benchmarks). Routers ask how long a prefix the store holds
(`KvLookup` -> `KvLookupReply.hit_blocks`). Prefill workers normally read the store files directly
(`kvstore.StoreReader`, using the `locations` of a lookup or their own view of the index);
`KvReadPages` fetches pages through the service instead.

A location is "segment:offset:length": the segment's sequence number (file
`<root>/segments/<segment as 12 digits>.kvs`), the record's byte offset in it and its length.
"""
from __future__ import annotations

from messages.common import TrafficClass
from messages.registry import Message, register


@register(0x0601)
class KvWritePages(Message):
    block_hashes: list[bytes]        # chain hashes of the blocks, in order
    page_frames: list[int]           # one buffer frame per block
    layout: str                      # page layout tag, stored with each record; a read may require it
    traffic_class: int = TrafficClass.CHATBOT
    ack: bool = False                # True: answer KvWriteAck once stored (else only errors are answered)


@register(0x0602)
class KvWriteAck(Message):
    written: int
    skipped: int = 0                 # already stored


@register(0x0603)
class KvLookup(Message):
    block_hashes: list[bytes]
    with_locations: bool = True      # routers that need only the hit length send False (cheaper)


@register(0x0604)
class KvLookupReply(Message):
    hit_blocks: int                  # longest prefix of the chain present in the store
    locations: list[str] = []        # where each hit block lives (segment:offset:length)


@register(0x0605)
class KvReadPages(Message):
    block_hashes: list[bytes]        # a chain, in order
    layout: str = ""                 # when set, a record stored under another layout is a miss


@register(0x0606)
class KvPages(Message):
    found: int                       # leading blocks read back intact (stops at the first miss, bad
                                     # checksum, or the service's per-reply byte limit: ask again)
    page_frames: list[int] = []      # buffer frame of each found block's page, in order
