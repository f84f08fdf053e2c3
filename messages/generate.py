"""Gateway <-> its upstream (the unified worker, or the prefill router in the E/P/D topology).

The gateway sends GenerateRequest; tokens come back as GenerateChunk messages addressed to the
gateway instance that owns the request (`return_address`), the last one with a finish reason.
AbortRequest cancels (client disconnect). The request id travels in the envelope header.
"""
from __future__ import annotations


from messages.common import SamplingParams, TopLogprob, TrafficClass, Usage
from messages.grammar import GrammarRef
from messages.images import ImageInput
from messages.registry import Message, register


@register(0x0201)
class GenerateRequest(Message):
    model: str
    prompt_ids: list[int]
    sampling: SamplingParams
    block_hashes: list[bytes] = []         # one per full 128-token block of the prompt
    traffic_class: int = TrafficClass.CHATBOT
    return_address: str = ""               # where GenerateChunk messages go
    arrival_time: float = 0.0
    images: list[ImageInput] = []          # the prompt's images, spans in prompt order (messages/images.py)
    grammar: GrammarRef | None = None      # an output constraint (structured output, forced tool calls)
    exact_prefix: bool = False             # no approximate prefix hit (V4.1 bounded replay): set on a
                                           # resumed attempt, which must continue exactly (gateway/resume.py)
    vision_groups: list[str] = []          # live vision balancers (group leaders): the prefill side picks one
                                           # at random to encode `images` (DeepSeek's rule)
    avoid_workers: list[str] = []          # addresses of workers that died under an earlier attempt of this
                                           # request (gateway/resume.py): not chosen again until they heartbeat


@register(0x0202)
class GenerateChunk(Message):
    token_ids: list[int]
    finish_reason: int = 0                 # messages.common.FinishReason
    logprobs: list[float] = []
    top_logprobs: list[list[TopLogprob]] = []
    usage: Usage | None = None             # on the last chunk
    error: str = ""
    worker: str = ""                       # address of the worker streaming the request (its first chunk):
                                           # the gateway aborts there and watches it for death
    worker_incarnation: str = ""           # that worker process's id: a restart at the same address differs
    first_index: int = -1                  # index in the attempt's output of token_ids[0] (-1 = not numbered):
                                           # the gateway drops tokens it has and fails on a gap, so a token two
                                           # workers send (the prefill's first, again from the decode) shows once


@register(0x0203)
class AbortRequest(Message):
    reason: str = ""
