"""SamplingParams.thinking_budget (Anthropic `thinking.budget_tokens`): output token N is forced to the
end-of-thinking token unless the model closed its thinking itself, and the answer goes on after it.
The tiny test model has no real `</think>`: any id stands in for it (the engine knows only the id)."""

from __future__ import annotations

import pytest

from engine.engine_core import EngineRequest
from messages.common import SamplingParams
from tests.engine.references import TEST_VOCAB, greedy_params, make_prompt, run_engine
from tests.engine.test_disaggregation import prefill
from tests.engine.test_handoff import over_the_wire

PROMPT = make_prompt(40, 5).tolist()


def _run(engine, params: SamplingParams, rid: str = "r"):
    engine.add_request(EngineRequest(rid, PROMPT, params))
    return run_engine(engine)[rid]


def _absent_from(tokens: list[int]) -> int:
    return next(t for t in range(TEST_VOCAB) if t not in tokens)


@pytest.mark.parametrize("budget", [0, 5])
def test_the_end_of_thinking_is_forced_at_the_budget_and_the_answer_continues(make_engine, budget):
    free = _run(make_engine(), greedy_params(16)).tokens
    think_end = _absent_from(free)
    out = _run(make_engine(), greedy_params(16, thinking_budget=budget, think_end_id=think_end)).tokens
    assert out[:budget] == free[:budget]
    assert out[budget] == think_end
    assert len(out) == 16   # the answer went on after the forced token


def test_a_thinking_section_the_model_closed_itself_is_left_alone(make_engine):
    free = _run(make_engine(), greedy_params(16)).tokens
    closed_at = 2
    think_end = free[closed_at]   # the model "ends its thinking" before the budget of 5
    assert think_end not in free[:closed_at]
    out = _run(make_engine(), greedy_params(16, thinking_budget=5, think_end_id=think_end)).tokens
    assert out == free


def test_a_forced_token_reports_the_models_own_logprob(make_engine):
    free = _run(make_engine(), greedy_params(8)).tokens
    think_end = _absent_from(free)
    out = _run(make_engine(), greedy_params(8, thinking_budget=3, think_end_id=think_end, logprobs=True))
    assert out.tokens[3] == think_end
    assert out.logprobs[3] < 0.0   # the raw distribution's, not the mask's certainty (0.0)


def test_the_budget_holds_across_the_prefill_to_decode_hand_off(make_engine):
    free = _run(make_engine(), greedy_params(12)).tokens
    params = greedy_params(12, thinking_budget=4, think_end_id=_absent_from(free))
    expected = _run(make_engine(), params).tokens
    request = EngineRequest("r", PROMPT, params)
    prefill_engine = make_engine()
    first = prefill(prefill_engine, request)
    snapshot, buffers = prefill_engine.snapshot("r")
    received, header, tensors, generated = over_the_wire(request, snapshot, buffers, first.new_token_ids)
    decode_engine = make_engine()
    decode_engine.restore(received, header, tensors, generated)
    assert first.new_token_ids + run_engine(decode_engine)["r"].tokens == expected


@pytest.mark.parametrize("fields, named", [
    (dict(thinking_budget=-2, think_end_id=1), "thinking_budget"),
    (dict(thinking_budget=3), "thinking_budget"),   # a budget without the token to force
    (dict(thinking_budget=3, think_end_id=TEST_VOCAB), "think_end_id"),
], ids=["negative", "no-token", "outside-vocab"])
def test_a_bad_thinking_budget_is_refused(make_engine, fields, named):
    with pytest.raises(ValueError, match=named):
        make_engine().add_request(EngineRequest("bad", PROMPT, SamplingParams(**fields)))
