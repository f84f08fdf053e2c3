"""Moving a request's state: snapshot -> the real wire encoding -> restore in a fresh engine, and
exporting completed blocks for the KV store."""

from __future__ import annotations

import msgspec
import pytest
import torch

from engine.engine_core import EngineRequest
from messages import Codec
from messages.generate import GenerateRequest
from messages.handoff import BufferRole, KVSnapshot, StateHandoff
from messages.prefix import block_hashes
from services.workers.tensors import to_frame, torch_frame
from tests.engine.references import greedy_params, make_prompt, run_engine


def step_until(engine, request_id: str, num_computed: int, with_logprobs: bool = False):
    """Step until the request's state holds `num_computed` tokens; the tokens it produced so far."""
    produced, logprobs = [], []
    while engine.requests[request_id].num_computed != num_computed:
        for out in engine.step():
            produced += out.new_token_ids
            logprobs += out.logprobs
    return (produced, logprobs) if with_logprobs else produced


def over_the_wire(request: EngineRequest, snapshot: KVSnapshot, buffers, generated: list[int]):
    """Encode a StateHandoff with the buffers as frames, decode it as the receiver would."""
    message = StateHandoff(
        request=GenerateRequest(model="tiny", prompt_ids=request.prompt_ids, sampling=request.sampling),
        snapshot=snapshot, buffer_frames=list(range(len(buffers))), generated_ids=generated)
    frames = Codec("prefill-0").encode(message, request_id=request.request_id, buffers=[to_frame(b) for b in buffers])
    wire = [bytes(f) for f in frames]  # what a socket would deliver
    envelope = Codec("decode-0").decode(wire)
    received = envelope.message
    tensors = [torch_frame(envelope, i) for i in received.buffer_frames]
    restored = EngineRequest(envelope.request_id, list(received.request.prompt_ids), received.request.sampling)
    return restored, received.snapshot, tensors, list(received.generated_ids)


@pytest.mark.parametrize("prompt_length, cut_at", [(200, 256), (300, 300)], ids=["boundary", "off-boundary"])
def test_a_snapshot_restored_in_a_fresh_engine_continues_identically(make_engine, greedy_alone, prompt_length, cut_at):
    expected = greedy_alone(prompt_length)
    request = EngineRequest("moving", make_prompt(prompt_length, 0).tolist(), greedy_params(logprobs=True))
    uninterrupted = make_engine()
    uninterrupted.add_request(request)
    expected_logprobs = run_engine(uninterrupted)["moving"].logprobs
    source = make_engine()
    source.add_request(request)
    produced, logprobs = step_until(source, "moving", cut_at, with_logprobs=True)
    snapshot, buffers = source.snapshot("moving")

    assert snapshot.num_tokens == cut_at and snapshot.model_id == source.model_id
    assert snapshot.roles == [BufferRole.PAGES, BufferRole.SWA, BufferRole.TAILS]
    assert snapshot.block_hashes == block_hashes(source.model_id, request.prompt_ids + produced)[: cut_at // 128]
    assert all(b.is_contiguous() and b.device.type == "cpu" for b in buffers)
    assert source.abort("moving")

    restored, header, tensors, generated = over_the_wire(request, snapshot, buffers, produced)
    target = make_engine()
    target.restore(restored, header, tensors, generated)
    result = run_engine(target)["moving"]
    assert produced + result.tokens == expected
    assert logprobs + result.logprobs == expected_logprobs  # bit-identical continuation
    assert result.last.num_prompt_tokens == prompt_length
    assert target.stats().swa_states_cached == (1 if cut_at % 128 == 0 else 0)  # a boundary hand-off is cached


def test_completed_blocks_export_every_full_block_with_its_chain_hash(make_engine):
    engine = make_engine()
    request = EngineRequest("w", make_prompt(200, 0).tolist(), greedy_params(80))
    engine.add_request(request)
    produced = step_until(engine, "w", 257)
    blocks = engine.completed_blocks("w")
    hashes = block_hashes(engine.model_id, request.prompt_ids + produced)
    assert [h for h, _ in blocks] == hashes[:2]  # one prompt block, one block of prompt + generated
    page_table = engine.requests["w"].state.page_table
    for (_, (page,)), page_id in zip(blocks, page_table):
        assert page.shape == (engine.kv.layout.page_numel,) and page.is_contiguous()
        assert torch.equal(page, engine.kv.pool.pages[page_id])
    assert [h for h, _ in engine.completed_blocks("w", first_block=1)] == hashes[1:2]

    run_engine(engine)  # finished: its blocks still come from the prefix cache
    assert [h for h, _ in engine.completed_blocks("w")] == hashes[:2]
    with pytest.raises(ValueError, match="no computed state"):
        engine.completed_blocks("unknown")


def test_restore_rejects_foreign_or_damaged_snapshots(make_engine):
    engine = make_engine()
    request = EngineRequest("x", make_prompt(130, 0).tolist(), greedy_params())
    engine.add_request(request)
    engine.step()
    snapshot, buffers = engine.snapshot("x")
    target = make_engine()

    def restore(header=snapshot, tensors=buffers, generated=(5,)):
        target.restore(EngineRequest("x", request.prompt_ids, request.sampling), header, tensors, generated)

    with pytest.raises(ValueError, match="of model"):
        restore(msgspec.structs.replace(snapshot, model_id="other-model"))
    with pytest.raises(ValueError, match="block hashes"):
        restore(msgspec.structs.replace(snapshot, block_hashes=[b"\0" * 16]))
    with pytest.raises(ValueError, match="layout"):
        restore(msgspec.structs.replace(snapshot, layout_version=99))
    with pytest.raises(ValueError, match="pages buffer"):
        restore(tensors=[buffers[0][:, :-1].contiguous(), *buffers[1:]])
    with pytest.raises(ValueError, match="tails buffer"):
        restore(tensors=[*buffers[:2], buffers[2][:-1]])
    with pytest.raises(ValueError, match="nothing left to feed"):
        restore(generated=())
    assert not target.has_unfinished()


def test_snapshot_needs_a_running_request(make_engine):
    engine = make_engine()
    engine.add_request(EngineRequest("w", [3, 4, 5], greedy_params()))
    with pytest.raises(ValueError, match="waiting"):
        engine.snapshot("w")
    with pytest.raises(ValueError, match="unknown"):
        engine.snapshot("nope")
