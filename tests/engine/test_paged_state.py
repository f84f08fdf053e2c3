"""The paged state (pages through a page table, window in a ring, tails) against the contiguous
oracle state, boundary captures, and the tail / window storage formats."""

from __future__ import annotations

import torch

from engine.kv.manager import KVCache
from engine.kv.paged_state import PagedState
from engine.kv.swa import SwaSlots
from engine.kv.tails import pack_tails, unpack_tails
from engine.models.common.state import split_state
from tests.engine.references import make_prompt, rel_err

CHUNKS = (1, 7, 61, 3, 129, 33, 200)


def paged_state(model, num_pages: int = 16) -> PagedState:
    kv = KVCache(model.config, num_pages, num_slots=2, device="cpu", dtype=torch.float32)
    state = PagedState(model.config, kv.pool, kv.slots, kv.tail_rings, kv.slots.allocate())
    state.page_table = list(reversed(kv.blocks.allocate(num_pages)))  # pages out of order on purpose
    return state


def test_paged_state_matches_the_contiguous_state_bit_for_bit(tiny_model, per_sequence_decode):
    model = per_sequence_decode(tiny_model(1))  # the batched decode path is checked in test_decode_batch.py
    prompt = make_prompt(sum(CHUNKS), 1)
    paged, contiguous = paged_state(model), model.new_state()
    start = 0
    for size in CHUNKS:
        piece = prompt[start : start + size]
        assert torch.equal(model([piece], [paged], all_logits=True), model([piece], [contiguous], all_logits=True))
        start += size
    token = torch.tensor([5])
    for _ in range(20):  # decode: the ring wraps, entries cross into a new page
        ours, theirs = model([token], [paged]), model([token], [contiguous])
        assert torch.equal(ours, theirs)
        token = ours.argmax(-1)
    assert paged.num_tokens == contiguous.num_tokens == sum(CHUNKS) + 20


def test_paged_and_contiguous_states_batch_together(tiny_model):
    model = tiny_model(1)
    prompts = [make_prompt(n, 1) for n in (300, 129)]
    paged = [paged_state(model), paged_state(model)]
    contiguous = [model.new_state(), model.new_state()]
    assert torch.equal(model(prompts, paged), model(prompts, contiguous))


def test_captures_inside_a_chunk_hold_the_state_at_each_boundary(tiny_model):
    model = tiny_model(0)
    config = model.config
    prompt = make_prompt(300, 0)
    state = paged_state(model)
    logits = model([prompt], [state], all_logits=True, captures=[(128, 256)])
    at_128, at_256 = state.take_captures()
    assert (at_128.num_tokens, at_256.num_tokens) == (128, 256)
    assert rel_err(model([prompt], [model.new_state()], all_logits=True), logits) <= 1e-5

    for boundary in (at_128, at_256):
        stopped = model.new_state()
        model([prompt[: boundary.num_tokens]], [stopped])
        parts = split_state(stopped, config)
        assert rel_err(torch.stack(parts.windows), boundary.windows) <= 1e-5
        tails = pack_tails(list(zip(parts.tails, parts.index_tails)), config, boundary.num_tokens, torch.float32)
        assert tails.shape == boundary.tails.shape and rel_err(tails, boundary.tails) <= 1e-5


def test_a_capture_at_the_end_of_a_chunk_is_exactly_the_state_there(tiny_model):
    model = tiny_model(0)
    prompt = make_prompt(256, 0)
    paged, contiguous = paged_state(model), model.new_state()
    model([prompt], [paged], captures=[(256,)])
    model([prompt], [contiguous])
    (captured,) = paged.take_captures()
    parts = split_state(contiguous, model.config)
    assert torch.equal(captured.windows, torch.stack(parts.windows))
    assert torch.equal(captured.tails, pack_tails(list(zip(parts.tails, parts.index_tails)), model.config, 256,
                                                  torch.float32))


def test_tails_round_trip_through_the_flat_layout(tiny_model):
    model = tiny_model(0)
    config = model.config
    for length in (3, 130, 256):
        state = model.new_state()
        model([make_prompt(length, 0)], [state])
        tails = [(layer.tail, layer.index_tail) for layer in state.layers]
        flat = pack_tails(tails, config, length, torch.float32)
        again = pack_tails(unpack_tails(flat, config, length, "cpu", torch.float32), config, length, torch.float32)
        assert torch.equal(flat, again)


def test_the_window_ring_reads_the_last_tokens_oldest_first():
    slots = SwaSlots(1, num_layers=1, window=4, head_dim=2, device="cpu", dtype=torch.float32)
    rows = torch.arange(22, dtype=torch.float32).view(11, 2)
    slots.write(0, 0, rows[:3], 0)
    assert torch.equal(slots.read(0, 0, 3), rows[:3])
    for position in range(3, 11):
        slots.write(0, 0, rows[position : position + 1], position)
        assert torch.equal(slots.read(0, 0, position + 1), rows[max(0, position - 3) : position + 1])
    slots.write(0, 0, rows[:6], 20)  # a chunk longer than the window keeps its last rows
    assert torch.equal(slots.read(0, 0, 26), rows[2:6])
