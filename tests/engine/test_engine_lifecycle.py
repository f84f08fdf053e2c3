"""Requests coming and going: stop conditions, aborts, adds between steps, page accounting, errors."""

from __future__ import annotations

import pytest

from engine.engine_core import EngineConfig, EngineRequest
from messages.common import FinishReason, SamplingParams
from tests.engine.references import greedy_params, make_prompt, run_engine


def request(rid: str, length: int, params: SamplingParams | None = None) -> EngineRequest:
    return EngineRequest(rid, make_prompt(length, 0).tolist(), params or greedy_params())


def assert_all_pages_returned(engine):
    stats, kv = engine.stats(), engine.kv
    assert stats.num_running == stats.num_waiting == 0
    assert stats.pages_free == stats.pages_total - stats.pages_cached
    assert stats.kv_usage == 0.0
    assert all(count == 0 for count in kv.blocks.ref_counts)
    assert kv.slots.num_free == engine.config.max_num_seqs


def test_eos_stops_unless_ignored_and_stop_tokens_stop(make_engine, greedy_alone):
    expected = greedy_alone(129)
    engine = make_engine()
    eos = expected[10]
    engine.scheduler.eos_token_ids = frozenset({eos})  # pretend this model's EOS is a token it produces
    at = expected.index(eos)
    engine.add_request(request("eos", 129, greedy_params(ignore_eos=False)))
    engine.add_request(request("ignored", 129, greedy_params(ignore_eos=True)))
    stop = expected[20]
    engine.add_request(request("stop", 129, greedy_params(stop_token_ids=[stop])))
    results = run_engine(engine)
    assert (results["eos"].tokens, results["eos"].finish_reason) == (expected[: at + 1], FinishReason.STOP)
    assert (results["ignored"].tokens, results["ignored"].finish_reason) == (expected, FinishReason.LENGTH)
    stopped_at = expected.index(stop)
    assert (results["stop"].tokens, results["stop"].finish_reason) == (expected[: stopped_at + 1], FinishReason.STOP)


def test_max_tokens_and_the_model_length_limit_stop_with_length(make_engine, greedy_alone):
    engine = make_engine(max_model_len=140)
    engine.add_request(request("short", 129, greedy_params(max_tokens=3)))
    engine.add_request(request("long", 129))
    results = run_engine(engine)
    assert (results["short"].tokens, results["short"].finish_reason) == (greedy_alone(129)[:3], FinishReason.LENGTH)
    assert (results["long"].tokens, results["long"].finish_reason) == (greedy_alone(129)[:11], FinishReason.LENGTH)


def test_aborting_mid_decode_returns_every_page(make_engine):
    engine = make_engine(num_pages=16)
    engine.add_request(request("a", 300))
    engine.add_request(request("b", 200))
    engine.add_request(request("c", 100))
    for _ in range(5):
        engine.step()
    assert engine.stats().kv_usage > 0
    assert engine.abort("a") and engine.abort("b") and engine.abort("c")
    assert not engine.abort("a") and not engine.abort("never-added")
    assert not engine.has_unfinished() and engine.step() == []
    assert_all_pages_returned(engine)
    assert engine.stats().pages_cached == 3  # a: 2 full prompt blocks, b: 1; c had none


def test_adds_and_aborts_between_steps(make_engine, greedy_alone):
    engine = make_engine()
    engine.add_request(request("first", 200))
    engine.add_request(request("doomed", 300))
    collected: dict[str, list[int]] = {}
    for step in range(200):
        if step == 3:
            engine.add_request(request("late", 129))
        if step == 6:
            assert engine.abort("doomed")
        if not engine.has_unfinished():
            break
        for out in engine.step():
            collected.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert collected["first"] == greedy_alone(200)
    assert collected["late"] == greedy_alone(129)
    assert collected["doomed"] == greedy_alone(300)[: len(collected["doomed"])]
    assert set(engine.request_ids()) == set()
    assert_all_pages_returned(engine)


def test_waiting_requests_respect_max_num_seqs_and_report_stats(make_engine):
    engine = make_engine(max_num_seqs=2)
    for i in range(4):
        engine.add_request(request(f"r{i}", 5, greedy_params(max_tokens=2)))
    engine.step()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (2, 2)
    assert engine.request_ids() == ["r0", "r1", "r2", "r3"]
    run_engine(engine)
    assert_all_pages_returned(engine)


@pytest.mark.parametrize(
    "make_request, message",
    [
        (lambda: EngineRequest("e", [], greedy_params()), "empty prompt"),
        (lambda: EngineRequest("", [1, 2], greedy_params()), "request_id"),
        (lambda: EngineRequest("v", [1, 5000], greedy_params()), "outside the vocabulary"),
        (lambda: EngineRequest("n", [1, -3], greedy_params()), "outside the vocabulary"),
        (lambda: EngineRequest("l", [7] * 300, greedy_params()), "max length 256"),
        (lambda: EngineRequest("t", [1, 2], SamplingParams(temperature=-1.0)), "temperature"),
        (lambda: EngineRequest("p", [1, 2], SamplingParams(top_p=0.0)), "top_p"),
        (lambda: EngineRequest("m", [1, 2], SamplingParams(max_tokens=0)), "max_tokens"),
        (lambda: EngineRequest("s", [1, 2], SamplingParams(seed="x")), "seed"),
    ],
)
def test_invalid_requests_get_clear_errors(make_engine, make_request, message):
    engine = make_engine(max_model_len=256)
    with pytest.raises(ValueError, match=message):
        engine.add_request(make_request())
    assert not engine.has_unfinished()


def test_duplicate_request_ids_are_rejected(make_engine):
    engine = make_engine()
    engine.add_request(request("same", 5))
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request(request("same", 7))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_pages": 0}, "num_pages"),
        ({"max_num_seqs": -1}, "max_num_seqs"),
        ({"max_batched_tokens": 0}, "max_batched_tokens"),
        ({"dtype": "int8"}, "dtype"),
        ({"max_model_len": 1}, "max_model_len"),
        ({"batch_invariant": True, "max_batched_tokens": 100}, "batch_invariant"),
        ({"model_dir": ""}, "model_dir"),
        ({"device": "gpu7"}, "device"),
    ],
)
def test_bad_engine_configs_are_rejected(overrides, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{"model_dir": "m", **overrides})
