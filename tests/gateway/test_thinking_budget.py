"""Anthropic `thinking.budget_tokens` reaches the worker as SamplingParams.thinking_budget with the id
of `</think>` (the engine forces it there, engine/sampling/thinking.py), and a budget the request
cannot use is a 400 naming the field, never accepted and ignored."""
from __future__ import annotations

import pytest

from services.gateway.adapter import GatewayError, Protocol
from tests.gateway.conftest import chat_body, messages_body

THINK_END = "</think>"


def test_an_enabled_budget_reaches_the_sampling_params_with_the_end_of_thinking_id(adapter):
    prepared = adapter.prepare(Protocol.MESSAGES, messages_body(
        max_tokens=2048, thinking={"type": "enabled", "budget_tokens": 1024}))
    s = prepared.sampling
    assert s.thinking_budget == 1024
    assert s.think_end_id == prepared.response.table.added_ids[THINK_END]


def test_a_chat_completions_budget_is_honoured_too(adapter):
    s = adapter.prepare(Protocol.CHAT, chat_body(thinking={"type": "enabled", "budget_tokens": 64})).sampling
    assert s.thinking_budget == 64 and s.think_end_id >= 0


def test_a_request_without_a_budget_sets_none(adapter):
    for body in (messages_body(), messages_body(thinking={"type": "disabled"})):
        s = adapter.prepare(Protocol.MESSAGES, body).sampling
        assert (s.thinking_budget, s.think_end_id) == (-1, -1)


BAD = {"missing": {"type": "enabled"},                          # required with enabled (Messages)
       "zero": {"type": "enabled", "budget_tokens": 0},
       "not-an-integer": {"type": "enabled", "budget_tokens": "many"},
       "not-below-max-tokens": {"type": "enabled", "budget_tokens": 256},
       "with-thinking-disabled": {"type": "disabled", "budget_tokens": 100}}   # would do nothing
CASES = [(protocol, name) for protocol in (Protocol.MESSAGES, Protocol.CHAT) for name in BAD
         if not (protocol is Protocol.CHAT and name == "missing")]   # Chat's {type: enabled} needs no budget


@pytest.mark.parametrize("protocol, case", CASES, ids=[f"{p.name.lower()}-{n}" for p, n in CASES])
def test_a_budget_that_cannot_be_honoured_is_a_400_naming_it(adapter, protocol, case):
    body = (messages_body if protocol is Protocol.MESSAGES else chat_body)(max_tokens=256, thinking=BAD[case])
    with pytest.raises(GatewayError) as caught:
        adapter.prepare(protocol, body)
    assert caught.value.status == 400 and caught.value.param == "thinking.budget_tokens"
