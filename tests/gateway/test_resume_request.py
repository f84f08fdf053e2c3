"""resume.py's next attempt of a request: prompt, budget, seeded draws and, for a constrained
request, the grammar's replay of what the client already received."""
from __future__ import annotations

import pytest

from messages.common import SamplingParams
from messages.generate import GenerateRequest
from messages.grammar import GrammarRef
from services.gateway.resume import resumed_request

REF = GrammarRef(key="k", constraint='{"kind":"json_object"}', tokenizer_id="t", compiler="tcp://c:1", after_token=9)


def first(grammar=None) -> GenerateRequest:
    return GenerateRequest(model="m", prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=10, seed=4),
                           grammar=grammar)


def test_an_attempt_continues_prompt_budget_and_draws():
    attempt = resumed_request(first(), [7, 8], "")
    assert attempt.prompt_ids == [1, 2, 3, 7, 8] and attempt.exact_prefix and attempt.grammar is None
    assert attempt.sampling.max_tokens == 8 and attempt.sampling.step_offset == 2


def test_a_constrained_attempt_replays_every_streamed_token_into_its_matcher():
    original = first(REF)
    once = resumed_request(original, [7, 8], "")
    twice = resumed_request(original, [7, 8, 9, 10], "")   # the gateway resumes from the first request each time
    assert once.grammar.replay == [7, 8] and twice.grammar.replay == [7, 8, 9, 10]
    assert (twice.grammar.key, twice.grammar.after_token, twice.grammar.compiler) == ("k", 9, "tcp://c:1")
    assert original.grammar.replay == []   # the first attempt's own ref is left alone


def test_nothing_left_is_no_attempt():
    with pytest.raises(ValueError):
        resumed_request(first(REF), list(range(10)), "")


def _thinking(budget: int) -> GenerateRequest:
    return GenerateRequest(model="m", prompt_ids=[1, 2, 3],
                           sampling=SamplingParams(max_tokens=10, thinking_budget=budget, think_end_id=9))


def test_an_attempt_keeps_what_is_left_of_the_thinking_budget():
    assert resumed_request(_thinking(5), [7, 8], "").sampling.thinking_budget == 3
    assert resumed_request(_thinking(2), [7, 8, 6], "").sampling.thinking_budget == 0   # spent: force at once


def test_an_attempt_after_the_thinking_ended_has_no_budget():
    assert resumed_request(_thinking(5), [7, 9, 8], "").sampling.thinking_budget == -1
    assert resumed_request(_thinking(-1), [7, 8], "").sampling.thinking_budget == -1
