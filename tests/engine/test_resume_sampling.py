"""A request resumed elsewhere (prompt + the tokens already streamed, SamplingParams.step_offset) samples
exactly what the uninterrupted request would: each draw depends on (seed, output index) only. The same
holds across the prefill -> decode hand-off, which restarts the generator on another engine."""

from __future__ import annotations

import pytest

from engine.engine_core import EngineRequest
from messages.common import SamplingParams
from tests.engine.references import make_prompt, run_engine
from tests.engine.test_disaggregation import prefill
from tests.engine.test_handoff import over_the_wire

SAMPLED = dict(temperature=1.0, top_k=50, top_p=0.95, seed=1234, max_tokens=24)


def _run(engine, request: EngineRequest) -> list[int]:
    engine.add_request(request)
    return run_engine(engine)[request.request_id].tokens


@pytest.mark.parametrize("cut", [1, 9, 23])
def test_a_resumed_seeded_request_continues_the_uninterrupted_draws(make_engine, cut):
    prompt = make_prompt(40, 3).tolist()
    whole = _run(make_engine(), EngineRequest("whole", prompt, SamplingParams(**SAMPLED)))
    assert len(whole) == 24 and len(set(whole)) > 4   # really sampled, not a constant
    resumed = SamplingParams(**{**SAMPLED, "max_tokens": 24 - cut, "step_offset": cut})
    rest = _run(make_engine(), EngineRequest("resumed", prompt + whole[:cut], resumed))
    assert whole[:cut] + rest == whole


def test_without_the_offset_the_resumed_draws_differ(make_engine):
    """The offset is what makes the resume exact (this test fails if the engine ignored it)."""
    prompt = make_prompt(40, 3).tolist()
    whole = _run(make_engine(), EngineRequest("whole", prompt, SamplingParams(**SAMPLED)))
    rest = _run(make_engine(), EngineRequest("r", prompt + whole[:9], SamplingParams(**{**SAMPLED, "max_tokens": 15})))
    assert whole[:9] + rest != whole


def test_a_seeded_hand_off_samples_what_a_unified_engine_does(make_engine):
    request = EngineRequest("r", make_prompt(150, 2).tolist(), SamplingParams(**SAMPLED))
    expected = _run(make_engine(), request)
    prefill_engine = make_engine()
    first = prefill(prefill_engine, request)
    snapshot, buffers = prefill_engine.snapshot("r")
    received, header, tensors, generated = over_the_wire(request, snapshot, buffers, first.new_token_ids)
    decode_engine = make_engine()
    decode_engine.restore(received, header, tensors, generated)
    assert first.new_token_ids + run_engine(decode_engine)["r"].tokens == expected


def test_a_negative_step_offset_is_refused(make_engine):
    with pytest.raises(ValueError, match="step_offset"):
        make_engine().add_request(EngineRequest("bad", [1, 2, 3], SamplingParams(step_offset=-1)))
