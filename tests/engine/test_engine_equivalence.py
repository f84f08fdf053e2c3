"""The same greedy continuation (64 tokens) through every engine path: alone, batched, chunked,
from the prefix cache, after preemption, in batch-invariant mode."""

from __future__ import annotations

import torch

from engine.engine_core import EngineRequest
from messages.common import FinishReason
from tests.engine.references import greedy_params, make_prompt, run_engine

BATCH_LENGTHS = (1, 5, 127, 128, 129, 200, 300, 450)


def request(rid: str, length: int, **params) -> EngineRequest:
    return EngineRequest(rid, make_prompt(length, 0).tolist(), greedy_params(**params))


def test_a_request_alone_continues_like_the_contiguous_oracle(make_engine, greedy_alone):
    engine = make_engine()
    engine.add_request(request("alone", 300))
    result = run_engine(engine)["alone"]
    assert result.tokens == greedy_alone(300)
    assert result.finish_reason == FinishReason.LENGTH
    assert result.last.num_prompt_tokens == 300 and result.last.num_cached_tokens == 0


def test_a_batch_of_mixed_lengths_matches_each_request_alone(make_engine, greedy_alone):
    engine = make_engine(enable_prefix_cache=False)
    for length in BATCH_LENGTHS:
        engine.add_request(request(f"r{length}", length))
    results = run_engine(engine)
    for length in BATCH_LENGTHS:
        assert results[f"r{length}"].tokens == greedy_alone(length), length


def test_chunked_prefill_with_odd_budgets_matches_alone(make_engine, greedy_alone):
    engine = make_engine(max_batched_tokens=37, enable_prefix_cache=False)
    for length in (300, 129, 5):
        engine.add_request(request(f"r{length}", length))
    results = run_engine(engine)
    for length in (300, 129, 5):
        assert results[f"r{length}"].tokens == greedy_alone(length), length


def test_a_shared_300_token_prefix_is_served_from_the_cache(make_engine, tiny_model):
    from engine.models.v4.generate import greedy_generate

    prefix = make_prompt(300, 3).tolist()
    first, second = prefix + make_prompt(20, 4).tolist(), prefix + make_prompt(41, 5).tolist()
    engine = make_engine()
    engine.add_request(EngineRequest("first", first, greedy_params()))
    run_engine(engine)
    engine.add_request(EngineRequest("second", second, greedy_params()))
    result = run_engine(engine)["second"]

    assert result.last.num_cached_tokens == 256  # two full blocks; the third is not full in the prefix
    assert engine.stats().prefix_hit_tokens_total == 256
    assert result.tokens == greedy_generate(tiny_model(0), torch.tensor(second), 64)


def test_a_prompt_fully_cached_still_computes_its_last_token(make_engine, greedy_alone):
    engine = make_engine()
    engine.add_request(request("a", 256))
    run_engine(engine)
    engine.add_request(request("b", 256))
    result = run_engine(engine)["b"]
    assert result.last.num_cached_tokens == 128  # block 2 is the whole rest of the prompt: recomputed
    assert result.tokens == greedy_alone(256)


def test_pool_exhaustion_preempts_and_every_request_still_matches_alone(make_engine, greedy_alone):
    engine = make_engine(num_pages=6, enable_prefix_cache=False)
    lengths = (230, 240, 250)  # 2 pages each at admission, a third each while decoding past 256
    for length in lengths:
        engine.add_request(request(f"r{length}", length))
    results = run_engine(engine)
    assert engine.stats().num_preemptions > 0
    for length in lengths:
        assert results[f"r{length}"].tokens == greedy_alone(length), length
    assert engine.stats().pages_free == 6


def test_batch_invariant_mode_gives_bit_identical_logprobs_whatever_the_batch(make_engine):
    def run(lengths, budget):
        engine = make_engine(batch_invariant=True, max_batched_tokens=budget, max_num_seqs=8,
                             enable_prefix_cache=False)
        for length in lengths:
            engine.add_request(EngineRequest(f"r{length}", make_prompt(length, 0).tolist(),
                                             greedy_params(24, logprobs=True)))
        return run_engine(engine)["r300"]

    alone = run([300], 136)
    crowded = run([300, 7, 129, 450], 300)
    assert crowded.tokens == alone.tokens
    assert crowded.logprobs == alone.logprobs  # exact floats, not approximately
