"""Resuming a request whose worker died: the stream goes on elsewhere, nothing repeated or lost.

The gateway is the one place that knows what the client has already received, so it resumes: a
failure that says a process holding the request is gone (the streaming worker died or froze, the
prefill rank died, the upstream router restarted) sends the request again as a new attempt. The
attempt's prompt is the original prompt plus every token already streamed; its max_tokens is what
is left; `step_offset` continues a seeded request's draws where they were (engine/sampling), so
greedy and seeded output equal an uninterrupted run's; a thinking budget keeps what is left of it.
The KV store and the SWA registry give the
new attempt the prompt's prefix back, exactly: `exact_prefix` turns V4.1's bounded replay (an
approximation) off for it, so it starts at the last block with a saved window state and
prefills the rest again. A constrained request's grammar replays the streamed tokens.

Each attempt travels under its own wire id (`<request id>#r<attempt>`). A chunk of an older
attempt (a frozen worker that wakes up, a prefill that was already under way when the router
died) finds no open request under its id: the gateway answers it with an abort, so the old
attempt stops there and none of its tokens reach the client.
"""
from __future__ import annotations

import msgspec

from messages.common import Usage
from messages.generate import GenerateRequest
from messages.prefix import block_hashes

# GatewayError codes that mean "a process holding the request is gone", not "the request is bad"
RESUMABLE = frozenset({"worker_died", "peer_dead", "upstream_lost"})


def wire_id(request_id: str, attempt: int) -> str:
    """The id an attempt travels under: the request id itself for the first one."""
    return request_id if attempt == 0 else f"{request_id}#r{attempt}"


def request_id_of(wire: str) -> str:
    return wire.split("#r", 1)[0]


def resumed_request(first: GenerateRequest, generated: list[int], model_id: str) -> GenerateRequest:
    """The next attempt of `first` after the client received `generated` (at least one token left)."""
    left = first.sampling.max_tokens - len(generated)
    if left < 1:
        raise ValueError(f"nothing left to resume: {len(generated)} of {first.sampling.max_tokens} tokens streamed")
    prompt = list(first.prompt_ids) + list(generated)
    sampling = msgspec.structs.replace(first.sampling, max_tokens=left,
                                       step_offset=first.sampling.step_offset + len(generated),
                                       thinking_budget=budget_left(first.sampling, generated))
    hashes = block_hashes(model_id, prompt, images=first.images) if model_id else []
    # A constrained request's matcher must stand where the client's output stands: it consumes the
    # streamed tokens first (thinking included: the constraint starts at its `</think>`).
    grammar = msgspec.structs.replace(first.grammar, replay=list(generated)) if first.grammar else None
    return msgspec.structs.replace(first, prompt_ids=prompt, sampling=sampling, block_hashes=hashes,
                                   exact_prefix=True, grammar=grammar)


def budget_left(sampling, generated: list[int]) -> int:
    """A thinking budget counts from the attempt's first output token: what the streamed tokens left of
    it, or -1 (off) once they closed the thinking section."""
    if sampling.thinking_budget < 0 or sampling.think_end_id in generated:
        return -1
    return max(0, sampling.thinking_budget - len(generated))


def client_usage(usage: Usage | None, prompt_tokens: int, generated_before: int) -> Usage | None:
    """A resumed attempt's usage, as the client's request sees it: its prompt is the original one,
    its completion counts every token streamed; cached tokens are the last attempt's, capped at
    the prompt."""
    if usage is None or not generated_before:
        return usage
    return Usage(prompt_tokens, min(usage.cached_tokens, prompt_tokens), generated_before + usage.completion_tokens)
