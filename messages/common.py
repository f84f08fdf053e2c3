"""Value types shared by several boundaries (not messages themselves)."""
from __future__ import annotations

from enum import IntEnum

import msgspec


class TrafficClass(IntEnum):
    """Decides the KV store's TTL (DeepSeek's: agent 3 days, chatbot 7 days)."""

    CHATBOT = 0
    AGENT = 1


class FinishReason(IntEnum):
    NONE = 0      # still running
    STOP = 1      # EOS or a stop token / sequence
    LENGTH = 2    # max_tokens or the context limit
    ABORT = 3     # cancelled by the client or the system
    ERROR = 4


class SamplingParams(msgspec.Struct, array_like=True, gc=False):
    temperature: float = 0.0    # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0              # 0 = off
    seed: int | None = None
    max_tokens: int = 256
    stop_token_ids: list[int] = []
    logprobs: bool = False
    top_logprobs: int = 0
    ignore_eos: bool = False
    step_offset: int = 0        # output tokens produced before this request (a resumed request's): its
                                # seeded draws continue at that index, as if it had never stopped
    thinking_budget: int = -1   # >= 0: once this many tokens were generated inside the thinking section,
    think_end_id: int = -1      # the next token is forced to think_end_id (Anthropic budget_tokens); -1 = off


class Usage(msgspec.Struct, array_like=True, gc=False):
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


class TopLogprob(msgspec.Struct, array_like=True, gc=False):
    token_id: int
    logprob: float
