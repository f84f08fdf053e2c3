"""The engine side of the E/P/D split: prefill-only requests held for hand-off, a decode engine
continuing a prefill engine's snapshot exactly like a unified engine, and importing a cached prefix
(KV-store pages + a peer's saved window and tails) from outside."""

from __future__ import annotations

import pytest
import torch

from engine.engine_core import EngineRequest
from engine.models.v4.generate import greedy_generate
from messages import Codec
from messages.handoff import BufferRole, KVSnapshot, SwaState
from messages.kv_store import KvPages
from messages.common import FinishReason
from messages.prefix import block_hashes
from services.workers.tensors import to_frame, torch_frame
from tests.engine.references import greedy_params, make_prompt, run_engine
from tests.engine.test_engine_lifecycle import assert_all_pages_returned
from tests.engine.test_handoff import over_the_wire


def prefill(engine, request: EngineRequest):
    """Run a prefill-only request to its first token; the one output it gives."""
    engine.add_request(request, prefill_only=True)
    outputs = [out for _ in range(1000) if engine.has_unfinished() for out in engine.step()]
    assert not engine.has_unfinished() and len(outputs) == 1
    return outputs[0]


# ---- 1. prefill-only requests -------------------------------------------------------------------

def test_prefill_only_emits_the_first_token_then_holds_the_state_until_released(make_engine, greedy_alone):
    engine = make_engine(max_batched_tokens=100)  # a 300-token prompt prefills in 3 chunks
    request = EngineRequest("p", make_prompt(300, 0).tolist(), greedy_params())
    engine.add_request(request, prefill_only=True)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    (out,) = outputs  # nothing before the first token, nothing after it
    assert out.new_token_ids == greedy_alone(300)[:1]
    assert (out.finish_reason, out.prefilled, out.num_prompt_tokens) == (None, True, 300)

    stats = engine.stats()
    assert (stats.num_held, stats.num_running, stats.num_waiting) == (1, 0, 0) and stats.kv_usage > 0
    assert engine.step() == [] and engine.request_ids() == ["p"]
    snapshot, buffers = engine.snapshot("p")
    assert snapshot.num_tokens == 300 and buffers[0].shape[0] == 3
    assert engine.snapshot("p")[0] == snapshot  # snapshotting does not change the held state
    assert [h for h, _ in engine.completed_blocks("p")] == block_hashes(engine.model_id, request.prompt_ids)

    assert engine.release("p") and not engine.release("p")
    assert engine.stats().num_held == 0 and engine.request_ids() == []
    assert_all_pages_returned(engine)
    assert engine.stats().pages_cached == 2  # its full prompt blocks stay in the prefix cache
    assert [h for h, _ in engine.completed_blocks("p")] == block_hashes(engine.model_id, request.prompt_ids)


def test_held_requests_are_aborted_like_any_other_and_release_needs_a_held_one(make_engine):
    engine = make_engine()
    prefill(engine, EngineRequest("held", make_prompt(200, 1).tolist(), greedy_params()))
    engine.add_request(EngineRequest("busy", make_prompt(50, 1).tolist(), greedy_params()), prefill_only=True)
    with pytest.raises(ValueError, match="not held"):
        engine.release("busy")  # still waiting for its prefill
    assert engine.abort("held") and engine.abort("busy")
    assert not engine.release("held") and not engine.abort("held")
    assert engine.stats().num_held == 0
    assert_all_pages_returned(engine)


def test_a_first_token_that_finishes_the_request_holds_nothing(make_engine, greedy_alone):
    engine = make_engine()
    out = prefill(engine, EngineRequest("one", make_prompt(129, 0).tolist(), greedy_params(max_tokens=1)))
    assert (out.new_token_ids, out.finish_reason, out.prefilled) == (greedy_alone(129)[:1], FinishReason.LENGTH, False)
    assert engine.stats().num_held == 0 and not engine.release("one")
    assert_all_pages_returned(engine)


def test_prefill_only_and_unified_requests_share_an_engine(make_engine, greedy_alone):
    engine = make_engine()
    engine.add_request(EngineRequest("whole", make_prompt(200, 0).tolist(), greedy_params()))
    engine.add_request(EngineRequest("first", make_prompt(129, 0).tolist(), greedy_params()), prefill_only=True)
    results = run_engine(engine)
    assert results["whole"].tokens == greedy_alone(200) and results["whole"].finish_reason == FinishReason.LENGTH
    assert results["first"].tokens == greedy_alone(129)[:1] and results["first"].last.prefilled
    assert engine.stats().num_held == 1 and engine.release("first")
    assert_all_pages_returned(engine)


# ---- 2. prefill engine -> wire -> decode engine ------------------------------------------------

@pytest.mark.parametrize("length", [1, 127, 128, 129, 300])
def test_a_decode_engine_continues_a_prefill_engines_snapshot_like_a_unified_engine(make_engine, greedy_alone,
                                                                                    length):
    request = EngineRequest("r", make_prompt(length, 0).tolist(), greedy_params(64, logprobs=True))
    unified = make_engine()
    unified.add_request(request)
    expected = run_engine(unified)["r"]
    assert expected.tokens == greedy_alone(length)

    prefill_engine = make_engine()
    first = prefill(prefill_engine, request)
    snapshot, buffers = prefill_engine.snapshot("r")
    assert snapshot.num_tokens == length and first.prefilled
    received, header, tensors, generated = over_the_wire(request, snapshot, buffers, first.new_token_ids)
    assert prefill_engine.release("r")

    decode_engine = make_engine()
    decode_engine.restore(received, header, tensors, generated)
    rest = run_engine(decode_engine)["r"]
    assert first.new_token_ids + rest.tokens == expected.tokens  # 64 tokens, the first one included
    assert first.logprobs + rest.logprobs == expected.logprobs  # bit-identical
    assert rest.finish_reason == FinishReason.LENGTH and rest.last.num_prompt_tokens == length

    # the prompt's full blocks are in the decode engine's prefix cache now (pages; a window state
    # only where the hand-off sat on a block boundary)
    prompt_hashes = block_hashes(decode_engine.model_id, request.prompt_ids)
    assert len(decode_engine.kv.blocks.lookup(prompt_hashes)) == length // 128
    assert_all_pages_returned(decode_engine)
    if length % 128 == 0:
        follow_up = request.prompt_ids + make_prompt(20, 4).tolist()
        decode_engine.add_request(EngineRequest("again", follow_up, greedy_params()))
        result = run_engine(decode_engine)["again"]
        assert result.last.num_cached_tokens == length
        assert result.tokens == greedy_generate(decode_engine.model, torch.tensor(follow_up), 64)


# ---- 3. importing a prefix from outside ---------------------------------------------------------

def pages_over_the_wire(blocks):
    """completed_blocks' pages as a KV store read would deliver them (KvPages, one frame per block)."""
    frames = Codec("kv-writer").encode(KvPages(found=len(blocks), page_frames=list(range(len(blocks)))),
                                       request_id="r", buffers=[to_frame(page) for _, (page,) in blocks])
    envelope = Codec("prefill-1").decode([bytes(f) for f in frames])
    return [[torch_frame(envelope, i)] for i in envelope.message.page_frames]


def boundary_over_the_wire(exported: tuple[KVSnapshot, list[torch.Tensor]], model_id: str):
    """export_boundary_state's answer served as SwaState (the SwaFetch reply); the fetcher rebuilds the
    header from what it asked for."""
    header, (window, tails) = exported
    assert header.roles == [BufferRole.SWA, BufferRole.TAILS]
    message = SwaState(found=True, num_tokens=header.num_tokens, swa_frames=[0], tail_frames=[1])
    frames = Codec("holder").encode(message, request_id="r", buffers=[to_frame(window), to_frame(tails)])
    envelope = Codec("prefill-1").decode([bytes(f) for f in frames])
    received = envelope.message
    rebuilt = KVSnapshot(model_id=model_id, num_tokens=received.num_tokens, block_hashes=header.block_hashes,
                         roles=[int(BufferRole.SWA), int(BufferRole.TAILS)])
    return rebuilt, [torch_frame(envelope, received.swa_frames[0]), torch_frame(envelope, received.tail_frames[0])]


@pytest.fixture(scope="module")
def peer(make_engine):
    """An engine that ran a 300-token prompt: its completed blocks and the prompt's block hashes."""
    engine = make_engine()
    prompt = make_prompt(300, 11).tolist()
    engine.add_request(EngineRequest("a", prompt, greedy_params(8)))
    run_engine(engine)
    blocks = engine.completed_blocks("a")
    hashes = block_hashes(engine.model_id, prompt)
    assert [h for h, _ in blocks] == hashes[:2]
    return engine, prompt, blocks, hashes


def run_one(engine, prompt: list[int]):
    engine.add_request(EngineRequest("b", prompt, greedy_params()))
    return run_engine(engine)["b"]


def test_an_imported_prefix_with_its_boundary_state_is_a_full_hit(make_engine, tiny_model, peer):
    source, prompt, blocks, hashes = peer
    exported = source.export_boundary_state(hashes[1])
    assert exported is not None and exported[0].num_tokens == 256 and exported[0].block_hashes == [hashes[1]]
    assert source.export_boundary_state(b"\1" * 16) is None
    second = prompt[:256] + make_prompt(44, 12).tolist()  # shares the two full blocks, then differs

    target = make_engine()
    header, buffers = boundary_over_the_wire(exported, target.model_id)
    assert target.import_prefix(hashes[:2], pages_over_the_wire(blocks), (header, buffers)) == 256
    stats = target.stats()
    assert (stats.pages_cached, stats.swa_states_cached, stats.kv_usage) == (2, 1, 0.0)  # cached, unreferenced
    result = run_one(target, second)
    assert result.last.num_cached_tokens == 256
    assert result.tokens == greedy_generate(tiny_model(0), torch.tensor(second), 64)  # == a cold run
    assert target.stats().prefix_hit_tokens_total == 256
    assert_all_pages_returned(target)


def test_without_the_state_at_the_last_boundary_the_hit_backs_off(make_engine, tiny_model, peer):
    source, prompt, blocks, hashes = peer
    second = prompt[:256] + make_prompt(44, 12).tolist()
    cold = greedy_generate(tiny_model(0), torch.tensor(second), 64)

    # the state at 256 is missing, the one at 128 (the block before) is served: the hit backs off one block
    target = make_engine()
    assert target.import_prefix(hashes[:2], [p for _, p in blocks], source.export_boundary_state(hashes[0])) == 128
    result = run_one(target, second)
    assert result.last.num_cached_tokens == 128 and result.tokens == cold

    # no state at all: pages alone cannot continue exactly (no bounded replay), so nothing is hit
    bare = make_engine()
    assert bare.import_prefix(hashes[:2], [p for _, p in blocks], None) == 0
    assert bare.stats().pages_cached == 2
    result = run_one(bare, second)
    assert result.last.num_cached_tokens == 0 and result.tokens == cold


def test_importing_what_is_already_cached_keeps_it_and_a_full_pool_imports_a_leading_part(make_engine, peer):
    source, prompt, blocks, hashes = peer
    pages = [p for _, p in blocks]
    state = source.export_boundary_state(hashes[1])
    engine = make_engine(num_pages=1)
    assert engine.import_prefix(hashes[:2], pages, state) == 0  # room for block 0 only; state 256 dropped
    assert engine.kv.blocks.lookup(hashes) == [engine.kv.blocks.hash_to_page[hashes[0]]]
    assert engine.stats().swa_states_cached == 0
    assert engine.import_prefix(hashes[:1], pages[:1], source.export_boundary_state(hashes[0])) == 128
    assert engine.stats().pages_cached == 1 and engine.stats().swa_states_cached == 1

    off = make_engine(enable_prefix_cache=False)
    assert off.import_prefix(hashes[:2], pages, state) == 0
    assert off.stats().pages_cached == off.stats().swa_states_cached == 0


def test_import_prefix_rejects_mismatched_input_before_changing_anything(make_engine, peer):
    source, prompt, blocks, hashes = peer
    pages = [p for _, p in blocks]
    header, buffers = source.export_boundary_state(hashes[1])
    engine = make_engine()
    with pytest.raises(ValueError, match="2 block hashes but 1 pages"):
        engine.import_prefix(hashes[:2], pages[:1])
    with pytest.raises(ValueError, match="block 1: page"):
        engine.import_prefix(hashes[:2], [pages[0], [pages[1][0][:-1]]])
    with pytest.raises(ValueError, match="block 0: page"):
        engine.import_prefix(hashes[:1], [[pages[0][0].double()]])
    with pytest.raises(ValueError, match="of model"):
        engine.import_prefix(hashes[:2], pages, (KVSnapshot(**{**_fields(header), "model_id": "x"}), buffers))
    with pytest.raises(ValueError, match="block hashes"):
        engine.import_prefix(hashes[:2], pages, (KVSnapshot(**{**_fields(header), "block_hashes": [hashes[0]]}),
                                                 buffers))
    with pytest.raises(ValueError, match="block hashes"):  # a boundary beyond the imported chain
        engine.import_prefix(hashes[:1], pages[:1], (header, buffers))
    with pytest.raises(ValueError, match="multiple of 128"):
        engine.import_prefix(hashes[:2], pages, (KVSnapshot(**{**_fields(header), "num_tokens": 200}), buffers))
    with pytest.raises(ValueError, match="window buffer"):
        engine.import_prefix(hashes[:2], pages, (header, [buffers[0][:, 1:].contiguous(), buffers[1]]))
    with pytest.raises(ValueError, match="tails buffer"):
        engine.import_prefix(hashes[:2], pages, (header, [buffers[0], buffers[1][:-1]]))
    stats = engine.stats()
    assert (stats.pages_cached, stats.swa_states_cached, stats.pages_free) == (0, 0, stats.pages_total)


def _fields(header: KVSnapshot) -> dict:
    return {name: getattr(header, name) for name in header.__struct_fields__}
