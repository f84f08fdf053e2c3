"""Worker <-> worker: moving a request's state (block pages, SWA window, compressor tails).

Tensors travel as buffer frames; fields hold frame indices into the envelope's buffers.
"""
from __future__ import annotations

from messages.generate import GenerateRequest
from messages.registry import Message, register


@register(0x0401)
class StateHandoff(Message):
    request: GenerateRequest
    num_tokens: int                  # tokens covered by the state
    layout: str                      # engine state layout identity (model + format version)
    page_frames: list[int] = []      # block-KV pages
    swa_frames: list[int] = []       # sliding-window KV per layer
    tail_frames: list[int] = []      # compressor overlap / pending state
    generated_ids: list[int] = []    # tokens already produced (migration)


@register(0x0402)
class StateAccepted(Message):
    accepted: bool = True
    reason: str = ""


@register(0x0403)
class SwaFetch(Message):
    prefix_hash: bytes


@register(0x0404)
class SwaState(Message):
    found: bool
    num_tokens: int = 0
    swa_frames: list[int] = []
    tail_frames: list[int] = []
