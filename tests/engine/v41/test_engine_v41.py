"""The engine on V4.1 (paged state with KV only at source layers, Engram lookback from the request's
ids): greedy output equals the contiguous-state oracle through batching, chunked prefill, prefix hits
with a window state, and the P->D hand-off (snapshot -> wire -> restore: the state moves as it is,
so these are exact with the cache rounding on); a hit without a window replays (engine/kv/manager.py) and passes the replay check's metadata level."""

from __future__ import annotations

import pytest
import torch

from engine.engine_core import EngineConfig, EngineCore, EngineRequest
from engine.loading import load_model
from engine.models.v4.generate import greedy_generate
from engine.models.v41.random_init import write_random_v41_model_dir
from engine.models.v41.replay_check import check_prompt
from messages.handoff import BufferRole
from tests.engine.references import TEST_VOCAB, greedy_params, make_prompt, run_engine
from tests.engine.test_handoff import over_the_wire, step_until

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def v41_dir(tmp_path_factory):
    return write_random_v41_model_dir("tiny-v41", tmp_path_factory.mktemp("v41") / "tiny-v41", seed=0,
                                      vocab_size=TEST_VOCAB)


@pytest.fixture(scope="module")
def oracle(v41_dir):
    """prompt length -> greedy continuation on the contiguous state, one sequence alone."""
    model, cache = load_model(v41_dir, dtype=torch.float32), {}

    def get(length: int) -> list[int]:
        if length not in cache:
            cache[length] = greedy_generate(model, make_prompt(length, 0), NEW_TOKENS)
        return cache[length]

    return get


def engine(v41_dir, **overrides) -> EngineCore:
    return EngineCore(EngineConfig(model_dir=str(v41_dir), dtype="float32", num_pages=64, max_num_seqs=4,
                                   **overrides))


def request(rid: str, length: int) -> EngineRequest:
    return EngineRequest(rid, make_prompt(length, 0).tolist(), greedy_params(NEW_TOKENS))


def test_batched_and_chunked_requests_equal_the_oracle(v41_dir, monkeypatch):
    """Without the cache round trips: a 96-row matmul and a 300-row one differ in the last bits, and
    such a difference now and then flips an fp4/fp8 rounding (see test_model_v41.py); what this
    checks is which tokens, entries and keys each query sees, which the rounding does not change."""
    for module in ("engine.models.v41.attention", "engine.models.v41.indexer"):
        monkeypatch.setattr(f"{module}.round_cache", lambda values, point: values)
    lengths = (140, 300, 257)
    model = load_model(v41_dir, dtype=torch.float32)
    expected = {length: greedy_generate(model, make_prompt(length, 0), NEW_TOKENS) for length in lengths}
    core = engine(v41_dir, max_batched_tokens=96, enable_prefix_cache=False)   # chunks of <= 96 tokens
    for length in lengths:
        core.add_request(request(f"r{length}", length))
    results = run_engine(core)
    for length in lengths:
        assert results[f"r{length}"].tokens == expected[length], length


def test_a_prefix_hit_with_its_window_continues_identically(v41_dir, oracle):
    core = engine(v41_dir)
    core.add_request(request("first", 300))
    assert run_engine(core)["first"].tokens == oracle(300)
    core.add_request(request("again", 300))
    again = run_engine(core)["again"]
    assert again.last.num_cached_tokens == 256 and again.tokens == oracle(300)


@pytest.mark.parametrize("length, cut_at", [(250, 256), (300, 301)], ids=["boundary", "off-boundary"])
def test_a_handoff_restored_in_a_fresh_engine_continues_identically(v41_dir, oracle, length, cut_at):
    source = engine(v41_dir)
    source.add_request(request("moving", length))
    produced = step_until(source, "moving", cut_at)
    snapshot, buffers = source.snapshot("moving")
    assert snapshot.roles == [BufferRole.PAGES, BufferRole.SWA, BufferRole.TAILS]
    restored, snapshot, tensors, generated = over_the_wire(request("moving", length), snapshot, buffers, produced)
    target = engine(v41_dir)
    target.restore(restored, snapshot, tensors, generated)
    rest = run_engine(target)["moving"].tokens
    assert produced + rest == oracle(length)


def test_a_hit_without_windows_replays_its_last_block(v41_dir):
    model = load_model(v41_dir, dtype=torch.float32)
    check = check_prompt(model, make_prompt(300, 1).tolist(), hit=256)
    assert all(check.metadata.values()), check.metadata
    assert check.after.rows == 300 - 256 - 1
    assert check.after.mean_abs < check.no_replay.mean_abs   # replay beats resuming without windows


def test_a_window_from_a_trimmed_replay_prefill_crosses_a_handoff_but_is_never_cached(v41_dir):
    """Bounded replay: what a trimmed replay computes is used for decode, never put in a prefix cache;
    that holds on the decode side of a P->D hand-off too (KVSnapshot.window_cacheable)."""
    prompt = make_prompt(384, 2).tolist()
    prefill = engine(v41_dir)
    prefill.add_request(EngineRequest("cached", prompt[:300], greedy_params(1)))
    run_engine(prefill)
    prefill.kv.boundaries.states.clear()          # the windows expire; the pages stay
    prefill.kv.boundaries.used_bytes = 0
    prefill.add_request(EngineRequest("moving", prompt, greedy_params(NEW_TOKENS)), prefill_only=True)
    first = run_engine(prefill)["moving"]
    assert first.last.prefilled and first.last.num_cached_tokens == 128   # a replay of block 1
    snapshot, buffers = prefill.snapshot("moving")
    assert snapshot.num_tokens == 384 and not snapshot.window_cacheable
    restored, snapshot, tensors, generated = over_the_wire(
        EngineRequest("moving", prompt, greedy_params(NEW_TOKENS)), snapshot, buffers, first.tokens)
    decode = engine(v41_dir)
    decode.restore(restored, snapshot, tensors, generated)
    produced = run_engine(decode)["moving"].tokens
    assert len(first.tokens + produced) == NEW_TOKENS
    assert len(decode.kv.boundaries) == 0   # the trimmed window at 384 was not cached
