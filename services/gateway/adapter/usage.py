"""Token usage in each protocol's shape, patched into the parser's usage-bearing events.

The stream parser computes usage from what it was fed; the adapter knows better (the worker's
counts, cache hits reported after the stream started, reasoning tokens counted per token), so the
events and bodies that carry usage get these numbers instead.
"""
from __future__ import annotations

from dataclasses import dataclass

from services.gateway.adapter.errors import Protocol


@dataclass(slots=True)
class TokenCounts:
    prompt: int = 0           # all prompt tokens, cached included
    cached: int = 0           # prompt tokens served from the prefix cache
    completion: int = 0       # generated tokens, reasoning included
    reasoning: int = 0

    def payload(self, protocol: Protocol) -> dict:
        if protocol is Protocol.CHAT:
            return {
                "prompt_tokens": self.prompt,
                "completion_tokens": self.completion,
                "total_tokens": self.prompt + self.completion,
                "prompt_tokens_details": {"cached_tokens": self.cached},
                "completion_tokens_details": {"reasoning_tokens": self.reasoning},
                "prompt_cache_hit_tokens": self.cached,
                "prompt_cache_miss_tokens": self.prompt - self.cached,
            }
        if protocol is Protocol.RESPONSES:
            return {
                "input_tokens": self.prompt,
                "input_tokens_details": {"cached_tokens": self.cached},
                "output_tokens": self.completion,
                "output_tokens_details": {"reasoning_tokens": self.reasoning},
                "total_tokens": self.prompt + self.completion,
            }
        return {
            "input_tokens": self.prompt - self.cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": self.cached,
            "output_tokens": self.completion,
            "service_tier": "standard",
        }


def patch_usage(event: dict, protocol: Protocol, counts: TokenCounts) -> bool:
    """Replace every non-null usage object in an event or body; return whether one was found."""
    found = False
    for holder in (event, event.get("message"), event.get("response")):
        if isinstance(holder, dict) and holder.get("usage") is not None:
            holder["usage"] = counts.payload(protocol)
            found = True
    return found
