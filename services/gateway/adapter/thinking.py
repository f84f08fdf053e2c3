"""`thinking.budget_tokens` (Anthropic Messages; Chat Completions takes the same object), honoured:
the thinking section ends after that many tokens.

The budget travels as SamplingParams.thinking_budget with the id of the model's end-of-thinking
token; the engine forces that token once the budget is spent, unless the model closed its thinking
itself, and the answer goes on (engine/sampling/thinking.py). Checked as Anthropic does: with
`type: "enabled"` the budget is required, a positive integer below `max_tokens`. A budget with any
other type, or for a request that does not think, is refused: it would be accepted and do nothing.
"""
from __future__ import annotations

from services.gateway.adapter.errors import Protocol, invalid_request

PARAM = "thinking.budget_tokens"
NO_BUDGET = -1
_READ_FROM = (Protocol.MESSAGES, Protocol.CHAT)   # Responses has no `thinking` object (its `reasoning` has no budget)


def requested_budget(protocol: Protocol, payload: dict) -> int:
    """The budget the body asks for, checked before conversion; NO_BUDGET when it asks for none."""
    thinking = payload.get("thinking") if protocol in _READ_FROM else None
    if not isinstance(thinking, dict) or ("budget_tokens" not in thinking and thinking.get("type") != "enabled"):
        return NO_BUDGET
    if protocol is Protocol.CHAT and "budget_tokens" not in thinking:
        return NO_BUDGET   # Chat's `thinking: {type: enabled}` switches thinking on; the budget is optional
    budget = thinking.get("budget_tokens")
    if thinking.get("type") != "enabled":
        raise invalid_request(f"{PARAM}: only allowed with thinking.type 'enabled'", param=PARAM)
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise invalid_request(f"{PARAM}: expected a positive integer, got {budget!r}", param=PARAM)
    return budget


def thinking_params(budget: int, max_tokens: int | None, parsing, added_ids: dict[str, int]) -> tuple[int, int]:
    """(thinking_budget, think_end_id) for SamplingParams, once the request is converted."""
    if budget == NO_BUDGET:
        return NO_BUDGET, -1
    if max_tokens is not None and budget >= max_tokens:
        raise invalid_request(f"max_tokens must be greater than {PARAM} ({max_tokens} <= {budget})", param=PARAM)
    in_thinking = parsing.thinking_stage is not None and parsing.thinking_stage.starts_in_reasoning()
    think_end = added_ids.get(parsing.think_end)
    if not in_thinking or think_end is None:   # this rendering has no thinking section to end
        raise invalid_request(f"{PARAM}: the request does not think (thinking mode is off)", param=PARAM)
    return budget, think_end
