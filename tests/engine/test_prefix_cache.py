"""Prefix cache rules: hits need the saved window + tails at their boundary, generated text is
cached too, and eviction drops pages and their boundary states together."""

from __future__ import annotations

import torch

from engine.engine_core import EngineRequest
from engine.models.v4.generate import greedy_generate
from messages.prefix import block_hashes
from tests.engine.references import greedy_params, make_prompt, run_engine


def cold(tiny_model, prompt: list[int]) -> list[int]:
    return greedy_generate(tiny_model(0), torch.tensor(prompt), 64)


def test_a_hit_backs_off_to_the_last_boundary_whose_window_state_is_saved(make_engine, tiny_model):
    prefix = make_prompt(300, 3).tolist()
    engine = make_engine()
    engine.add_request(EngineRequest("first", prefix + [1, 2, 3], greedy_params(8)))
    run_engine(engine)
    hashes = block_hashes(engine.model_id, prefix)
    assert engine.kv.blocks.lookup(hashes) and hashes[1] in engine.kv.boundaries
    engine.kv.boundaries.discard(hashes[1])  # pages of both blocks stay, the state at 256 is gone

    second = prefix + make_prompt(41, 5).tolist()
    engine.add_request(EngineRequest("second", second, greedy_params()))
    result = run_engine(engine)["second"]
    assert result.last.num_cached_tokens == 128
    assert result.tokens == cold(tiny_model, second)


def test_generated_tokens_are_cached_for_the_next_turn(make_engine, tiny_model):
    engine = make_engine()
    prompt = make_prompt(200, 6).tolist()
    engine.add_request(EngineRequest("turn1", prompt, greedy_params()))
    answer = run_engine(engine)["turn1"].tokens
    follow_up = prompt + answer + make_prompt(10, 7).tolist()  # 274 tokens: block 2 ends inside the answer
    engine.add_request(EngineRequest("turn2", follow_up, greedy_params()))
    result = run_engine(engine)["turn2"]
    assert result.last.num_cached_tokens == 256
    assert result.tokens == cold(tiny_model, follow_up)


def test_evicted_blocks_take_their_boundary_states_and_later_requests_recompute(make_engine, tiny_model):
    engine = make_engine(num_pages=4)
    shared = make_prompt(260, 8).tolist()
    engine.add_request(EngineRequest("a", shared, greedy_params(4)))
    run_engine(engine)
    assert engine.stats().pages_cached == 2 and engine.stats().swa_states_cached == 2
    engine.add_request(EngineRequest("filler", make_prompt(500, 9).tolist(), greedy_params(2)))
    run_engine(engine)  # needs all 4 pages: evicts a's cached blocks
    assert engine.stats().swa_states_cached == 3  # filler's three boundaries; a's two are gone
    engine.add_request(EngineRequest("b", shared + [4, 5], greedy_params()))
    result = run_engine(engine)["b"]
    assert result.last.num_cached_tokens == 0
    assert result.tokens == cold(tiny_model, shared + [4, 5])


def test_without_the_prefix_cache_nothing_is_kept(make_engine):
    engine = make_engine(enable_prefix_cache=False)
    prompt = make_prompt(300, 3).tolist()
    for rid in ("a", "b"):
        engine.add_request(EngineRequest(rid, prompt, greedy_params(2)))
        assert run_engine(engine)[rid].last.num_cached_tokens == 0
    stats = engine.stats()
    assert (stats.pages_cached, stats.swa_states_cached, stats.pages_free) == (0, 0, stats.pages_total)
