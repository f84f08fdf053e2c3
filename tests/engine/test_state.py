"""Per-sequence state: its shapes, and cutting it at a 128-token block boundary and rebuilding it."""

from __future__ import annotations

import pytest
import torch

from engine.models.v4.config import CSA, HCA, SLIDING
from engine.models.v4.generate import prefill
from engine.models.common.state import join_state, split_state, state_nbytes
from tests.engine.references import make_prompt

BLOCK = 128


def run_tokens(model, state, tokens: list[int]) -> list[torch.Tensor]:
    return [model([torch.tensor([t])], [state])[0] for t in tokens]


def continue_greedy(model, state, logits, steps):
    out = [logits]
    for _ in range(steps):
        out.append(model([out[-1].argmax().reshape(1)], [state])[0])
    return torch.stack(out)


def test_state_holds_window_entries_and_tails(tiny_model):
    model = tiny_model(0)
    config = model.config
    state = model.new_state()
    prefill(model, state, make_prompt(301, 0))
    assert state.num_tokens == 301
    for i, layer in enumerate(state.layers):
        assert layer.window.shape == (config.sliding_window, config.head_dim)
        kind = config.layer_types[i]
        if kind == SLIDING:
            assert layer.entries is None and layer.tail is None
        if kind == CSA:
            assert layer.entries.shape == (75, config.head_dim)
            assert layer.index_keys.shape == (75, config.index_head_dim)
            assert layer.tail.pending_kv.shape == (1, 2 * config.head_dim)
            assert layer.tail.overlap_kv.shape == (4, config.head_dim)
            assert layer.index_tail.overlap_gate.shape == (4, config.index_head_dim)
        if kind == HCA:
            assert layer.entries.shape == (2, config.head_dim)
            assert layer.tail.pending_kv.shape == (45, config.head_dim)
            assert layer.tail.overlap_kv is None
    sizes = state_nbytes(state)
    assert sizes["window"] == config.num_layers * config.sliding_window * config.head_dim * 4
    assert sizes["block"] > 0 and sizes["tails"] > 0


@pytest.mark.parametrize("prefill_tokens, decoded_to_boundary", [(256, 0), (200, 56)])
def test_state_rebuilt_from_blocks_window_and_tails_continues_bit_identically(
    tiny_model, prefill_tokens, decoded_to_boundary
):
    model = tiny_model(1)
    prompt = make_prompt(prefill_tokens + decoded_to_boundary + 40, 1)
    state = model.new_state()
    prefill(model, state, prompt[:prefill_tokens])
    run_tokens(model, state, prompt[prefill_tokens : prefill_tokens + decoded_to_boundary].tolist())
    assert state.num_tokens == 2 * BLOCK
    parts = split_state(state, model.config, BLOCK)
    assert len(parts.blocks) == 2
    assert all(tail is None or tail.pending_kv.shape[0] == 0 for tail in parts.tails + parts.index_tails)
    rebuilt = join_state(parts, model.config)

    rest = prompt[2 * BLOCK :]
    original_logits = model([rest], [state], all_logits=True)
    rebuilt_logits = model([rest], [rebuilt], all_logits=True)
    assert torch.equal(original_logits, rebuilt_logits)
    original = continue_greedy(model, state, original_logits[-1], 64)
    again = continue_greedy(model, rebuilt, rebuilt_logits[-1], 64)
    assert torch.equal(original, again)


def test_dropping_the_csa_overlap_changes_the_continuation(tiny_model):
    """The overlap tail is real state even at a block boundary (a negative control)."""
    model = tiny_model(1)
    prompt = make_prompt(2 * BLOCK + 8, 1)
    state = model.new_state()
    prefill(model, state, prompt[: 2 * BLOCK])
    parts = split_state(state, model.config, BLOCK)
    for tail in parts.tails + parts.index_tails:
        if tail is not None:
            tail.overlap_kv = tail.overlap_gate = None
    rebuilt = join_state(parts, model.config)
    rest = prompt[2 * BLOCK :]
    assert not torch.equal(model([rest], [state], all_logits=True), model([rest], [rebuilt], all_logits=True))


def test_split_rejects_a_state_off_the_block_boundary(tiny_model):
    model = tiny_model(0)
    state = model.new_state()
    prefill(model, state, make_prompt(130, 0))
    with pytest.raises(ValueError, match="multiple of the block size"):
        split_state(state, model.config, BLOCK)


def test_cloned_state_is_independent(tiny_model):
    model = tiny_model(0)
    state = model.new_state()
    logits = prefill(model, state, make_prompt(131, 0))
    copy = state.clone()
    first = run_tokens(model, state, [5, 6, 7])
    second = run_tokens(model, copy, [5, 6, 7])
    assert state.num_tokens == copy.num_tokens == 134
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert logits.shape == (model.config.vocab_size,)
