"""Worker <-> worker: moving a request's state (block pages, SWA window, compressor tails).

Tensors travel as buffer frames; fields hold frame indices into the envelope's buffers.
`KVSnapshot` describes a state cut by the engine (`EngineCore.snapshot`): which model and layout
made it, how many tokens it covers, the hash chain of its full blocks, and the role of each
buffer. The receiver checks all of it before restoring (`EngineCore.restore`).
`StateHandoff` also carries the tokens the sender already produced with their logprobs (laid out
as in GenerateChunk), which the receiver streams first.
"""
from __future__ import annotations

from enum import IntEnum

import msgspec

from messages.common import TopLogprob
from messages.generate import GenerateRequest
from messages.prefix import BLOCK_TOKENS
from messages.registry import Message, register

KV_LAYOUT_VERSION = 1


class BufferRole(IntEnum):
    PAGES = 0     # [num_pages, page_numel]: block KV of every page the state touches, in order (last may be partial)
    SWA = 1       # [num_layers, min(num_tokens, window), head_dim]: sliding-window KV, oldest first
    TAILS = 2     # flat compressor tails (pending tokens + CSA overlaps; engine.kv.tails layout)


class KVSnapshot(msgspec.Struct, array_like=True, gc=False):
    model_id: str = ""               # engine model identity (also keys the hash chain)
    layout_version: int = KV_LAYOUT_VERSION
    block_size: int = BLOCK_TOKENS
    num_tokens: int = 0              # tokens whose state the buffers hold
    block_hashes: list[bytes] = []   # chain hash of each full block of those tokens
    roles: list[int] = []            # BufferRole of each buffer, in buffer order
    num_cached_tokens: int = 0       # prompt tokens the sender took from its prefix cache (usage)
    window_cacheable: bool = True    # False: the window came out of a trimmed replay prefill (V4.1,
                                     # bounded replay): the receiver continues from it but never caches it


@register(0x0401)
class StateHandoff(Message):
    request: GenerateRequest
    snapshot: KVSnapshot
    buffer_frames: list[int] = []    # frame index of each snapshot buffer (roles in snapshot.roles)
    generated_ids: list[int] = []    # tokens already produced (the prefill's first one; more on migration)
    logprobs: list[float] = []       # one per generated id when the request asked for logprobs, else empty
    top_logprobs: list[list[TopLogprob]] = []   # one row per generated id when it asked for top logprobs
    grammar: str = ""                # the compiled constraint (request.grammar's artifact): the decode side
                                     # rebuilds the matcher from it and replays generated_ids, no compiler call
    image_frames: list[int] = []     # per request image: the frame of its span rows [tokens, hidden], or -1.
                                     # Rows travel for the images a recompute of the prompt's tail would
                                     # need (a preemption on the decode side replays from the last cached
                                     # block); empty when the request has no images


@register(0x0402)
class StateAccepted(Message):
    accepted: bool = True
    reason: str = ""


@register(0x0403)
class SwaFetch(Message):
    """The window + tails state at the first of `prefix_hashes` (block boundaries, best first) that
    the receiver can serve, answered with SwaState. Sent to the SWA registry, which forwards it to
    the holder (setting `reply_msg_id`); the holder then answers `reply_to` directly, as a reply
    to the original call (one round trip for the requester)."""

    prefix_hashes: list[bytes]
    reply_to: str = ""             # the requester's address (set by the requester)
    reply_msg_id: str = ""         # the requester's call id (set by the registry when it forwards)
    requester_incarnation: str = ""   # the requesting process (Service.incarnation): a new one at
                                      # reply_to retires what its predecessor registered there


@register(0x0404)
class SwaState(Message):
    found: bool
    num_tokens: int = 0
    swa_frames: list[int] = []
    tail_frames: list[int] = []
    prefix_hash: bytes = b""       # the boundary the state is at (one of the asked hashes)
