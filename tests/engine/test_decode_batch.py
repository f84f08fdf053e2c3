"""The batched decode path (engine.kv.decode_view) against the per-sequence path on paged states:
sequences at different positions in one step, crossing CSA and HCA windows, page boundaries, the
indexer's top-k threshold and block captures together; a window shorter than 128; the tail rings."""

from __future__ import annotations

import json

import pytest
import torch

from engine.kernels import kernel_mode
from engine.kernels.dispatch import pinned
from engine.kv.manager import KVCache
from engine.kv.paged_state import PagedState
from engine.kv.tails import TailRings, pack_tails
from engine.models.v4 import load_model
from engine.models.v4.config import read_config_dict
from engine.models.v4.random_init import write_random_model_dir
from tests.engine.references import TEST_VOCAB, make_prompt, rel_err

# prompt lengths: before / after the first CSA window, around the top-k threshold (16 entries = 64
# tokens), around the first HCA window and page boundary (128), the second (256); 14 steps each
LENGTHS = (1, 2, 5, 62, 63, 120, 125, 126, 127, 128, 129, 250, 253)
STEPS = 14


def lockstep(model, lengths, steps: int, batched: bool, seed: int = 0):
    """Prefill each prompt alone, then decode `steps` given tokens for all sequences together.
    Returns the decode logits [steps, B, vocab], the states and the captures they took."""
    config, previous, device = model.config, model.batched_decode, model.device
    num_pages = sum(-(-(n + steps) // 128) for n in lengths)
    kv = KVCache(config, num_pages=num_pages, num_slots=len(lengths), device=device, dtype=model.dtype)
    states = []
    for n in lengths:
        state = PagedState(config, kv.pool, kv.slots, kv.tail_rings, kv.slots.allocate())
        state.page_table = list(reversed(kv.blocks.allocate(-(-(n + steps) // 128))))  # out of order on purpose
        model([make_prompt(n, seed).to(device)], [state])
        states.append(state)
    fed = [make_prompt(steps, seed + 100 + i).to(device) for i in range(len(lengths))]
    logits, captures = [], {}
    model.batched_decode = batched
    try:
        for step in range(steps):
            boundaries = [((s.num_tokens + 1),) if (s.num_tokens + 1) % 128 == 0 else () for s in states]
            logits.append(model([f[step : step + 1] for f in fed], states, captures=boundaries))
            for i, state in enumerate(states):
                for boundary in state.take_captures():
                    captures[i, boundary.num_tokens] = boundary
    finally:
        model.batched_decode = previous
    return torch.stack(logits), states, captures


def close(reference: torch.Tensor, ours: torch.Tensor, tolerance: float = 1e-5) -> bool:
    return reference.shape == ours.shape and (reference.numel() == 0 or rel_err(reference, ours) <= tolerance)


def assert_same_states(config, batched, alone, tolerance: float = 1e-5):
    for a, b in zip(batched, alone):
        assert a.num_tokens == b.num_tokens
        sa, sb = a.boundary_state(), b.boundary_state()
        assert close(sb.windows, sa.windows, tolerance) and close(sb.tails, sa.tails, tolerance)
        for layer in range(config.num_layers):
            if config.compress_ratio(layer):
                count = a.num_tokens // config.compress_ratio(layer)
                assert close(b.entries(layer, count), a.entries(layer, count), tolerance), layer
            if b.pool.index_keys[layer] is not None:
                count = a.num_tokens // config.compress_ratio(layer)
                assert close(b.index_keys(layer, count), a.index_keys(layer, count), tolerance), layer


def test_a_batched_step_matches_each_sequence_on_its_own_path(tiny_model):
    model = tiny_model(0)
    batched, states, captured = lockstep(model, LENGTHS, STEPS, batched=True)
    alone, reference, expected = lockstep(model, LENGTHS, STEPS, batched=False)
    assert rel_err(alone, batched) <= 1e-5
    assert torch.equal(batched.argmax(-1), alone.argmax(-1))
    assert_same_states(model.config, states, reference)
    assert sorted(captured) == sorted(expected) and len(expected) >= 4  # boundaries 128 and 256 were crossed
    for key, boundary in expected.items():
        assert rel_err(boundary.windows, captured[key].windows) <= 1e-5
        assert rel_err(boundary.tails, captured[key].tails) <= 1e-5


def test_one_sequence_alone_takes_the_batched_path_and_matches(tiny_model):
    model = tiny_model(1)
    batched, states, _ = lockstep(model, (126,), 8, batched=True, seed=1)
    alone, reference, _ = lockstep(model, (126,), 8, batched=False, seed=1)
    assert rel_err(alone, batched) <= 1e-5
    assert_same_states(model.config, states, reference)


@pytest.fixture(scope="module")
def short_window_model(tmp_path_factory):
    """The tiny model with a 16-token sliding window (the ring wraps every 16 decode steps)."""
    raw = read_config_dict("tiny")
    raw["sliding_window"] = 16
    path = tmp_path_factory.mktemp("short") / "config.json"
    path.write_text(json.dumps(raw))
    directory = write_random_model_dir(path, tmp_path_factory.mktemp("short-model"), seed=2, vocab_size=TEST_VOCAB,
                                       dtype=torch.float32)
    return load_model(directory, dtype=torch.float32)


def test_a_window_shorter_than_a_block_matches_too(short_window_model):
    model = short_window_model
    assert model.config.sliding_window == 16
    lengths = (1, 9, 15, 16, 17, 40, 126)
    batched, states, _ = lockstep(model, lengths, 20, batched=True, seed=2)
    alone, reference, _ = lockstep(model, lengths, 20, batched=False, seed=2)
    assert rel_err(alone, batched) <= 1e-5
    assert_same_states(model.config, states, reference)


def test_tail_rings_give_back_what_was_written_at_any_position(tiny_model):
    config = tiny_model(0).config
    rings = TailRings(config, num_slots=2, device="cpu", dtype=torch.float32)
    state = tiny_model(0).new_state()
    for length in (3, 4, 130, 131):  # pending only; pending + overlap; HCA past its first window
        state = tiny_model(0).new_state()
        tiny_model(0)([make_prompt(length, 3)], [state])
        for layer in range(config.num_layers):
            for indexer in (False, True):
                tail = state.tail(layer, length, indexer)
                if tail is None:
                    continue
                rings.write(1, (layer, indexer), length, tail)
                again = rings.read(1, (layer, indexer), length)
                for ours, theirs in zip((again.pending_kv, again.pending_gate, again.overlap_kv, again.overlap_gate),
                                        (tail.pending_kv, tail.pending_gate, tail.overlap_kv, tail.overlap_gate)):
                    assert (ours is None and theirs is None) or torch.equal(ours, theirs)
        flat = pack_tails([(layer.tail, layer.index_tail) for layer in state.layers], config, length, torch.float32)
        assert flat.numel() > 0


def bench8_narrow(dtype):
    """bench8's attention widths (512-entry top-k, 64 heads of 512), 4 layers (sliding, sliding, CSA,
    HCA), few experts, drawn on the GPU."""
    from engine.models.v4.config import ModelConfig
    from bench.engine.weights import draw_model

    raw = read_config_dict("bench8")
    raw.update(num_hidden_layers=4, n_routed_experts=8, moe_intermediate_size=256, vocab_size=TEST_VOCAB,
               num_hash_layers=1)
    return draw_model(ModelConfig.from_dict(raw), torch.device("cuda"), dtype, seed=0)


CUDA_LENGTHS = (1, 5, 127, 300, 2047, 2051, 2100, 4000)  # up to 1000 entries: the top-k selects


KERNELS_BF16_GAP = pytest.mark.xfail(strict=True, reason=(
    "H200, 2026-12-01: with the fused kernels in bf16 the batched and per-sequence decode paths (two "
    "different attention kernels) differ by 0.26 relative, against 0.05 for the torch path; the gap comes "
    "from one sequence just past the indexer's top-k, where bf16 noise flips a near-tied selection"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,kernels", [(torch.float32, "off"), (torch.bfloat16, "off"), (torch.float32, "auto"),
                                           pytest.param(torch.bfloat16, "auto", marks=KERNELS_BF16_GAP)])
def test_on_cuda_with_bench8_widths_past_the_top_k(dtype, kernels):
    model = bench8_narrow(dtype)
    model.decode_graphs.enabled = False
    with kernel_mode(kernels):
        batched, states, _ = lockstep(model, CUDA_LENGTHS, 6, batched=True)
        alone, reference, _ = lockstep(model, CUDA_LENGTHS, 6, batched=False)
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    err = rel_err(alone, batched)
    print(f"cuda {dtype}: batched vs per-sequence logits rel err {err:.2e}, argmax equal "
          f"{(batched.argmax(-1) == alone.argmax(-1)).float().mean().item():.3f}")
    assert err <= tolerance
    if dtype == torch.float32:
        assert torch.equal(batched.argmax(-1), alone.argmax(-1))
    assert_same_states(model.config, states, reference, tolerance)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replays_match_the_eager_batched_path():
    model = bench8_narrow(torch.bfloat16)
    lengths = CUDA_LENGTHS[:5] + (126, 1020)  # 7 sequences: a padded batch of 8; 126 and 1020 cross a page
    model.decode_graphs.enabled = False
    eager, eager_states, _ = lockstep(model, lengths, 12, batched=True)
    model.decode_graphs.enabled = True
    graphed, graphed_states, _ = lockstep(model, lengths, 12, batched=True)
    graphs = model.decode_graphs
    assert graphs.error is None and graphs.graphs, graphs.error
    err = rel_err(eager, graphed)
    print(f"cuda bf16: graphed vs eager batched logits rel err {err:.2e}, graphs (batch, pages) "
          f"{sorted(key[1:] for key in graphs.graphs)}")
    assert err <= 5e-2  # bf16, and the padded shapes run other matmul kernels
    assert_same_states(model.config, graphed_states, eager_states, 5e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_forward_that_cannot_be_captured_falls_back_to_eager():
    model = bench8_narrow(torch.float32)
    lengths = (5, 300)
    with pinned(["moe"], False):   # the torch path's fp32 experts loop, reading counts on the host: no capture
        model.decode_graphs.enabled = False
        eager, _, _ = lockstep(model, lengths, 3, batched=True)
        model.decode_graphs.enabled = True
        fallback, _, _ = lockstep(model, lengths, 3, batched=True)
    assert not model.decode_graphs.enabled and "capture" in model.decode_graphs.error
    assert torch.equal(eager, fallback)


def test_decodes_batched_beside_a_prefill_chunk_match_the_per_sequence_path(tiny_model):
    model = tiny_model(0)

    def run(batched: bool):
        kv = KVCache(model.config, num_pages=16, num_slots=4, device="cpu", dtype=torch.float32)
        states = []
        for n in (5, 127, 130, 0):
            state = PagedState(model.config, kv.pool, kv.slots, kv.tail_rings, kv.slots.allocate())
            state.page_table = kv.blocks.allocate(3)
            if n:
                model([make_prompt(n, 4)], [state])
            states.append(state)
        previous, model.batched_decode = model.batched_decode, batched
        try:
            token = torch.tensor([7])
            first = model([token, token, token, make_prompt(40, 5)], states)  # three decodes, then a prefill
            second = model([token, token, token, make_prompt(3, 6)], states)
            third = model([token] * 4, states)
        finally:
            model.batched_decode = previous
        return torch.cat([first, second, third]), states

    batched, states = run(True)
    alone, reference = run(False)
    assert rel_err(alone, batched) <= 1e-5
    assert_same_states(model.config, states, reference)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_graph_replay_is_bitwise_the_eager_forward_of_the_same_shapes():
    from engine.models.v4.decode_graph import DecodeGraphs

    model = bench8_narrow(torch.bfloat16)
    _, states, _ = lockstep(model, (3, 126, 700), 2, batched=True)  # a padded batch of 4, pages 8
    ids = torch.tensor([11, 12, 13], device="cuda")
    view_type = type(states[0]).decode_view_type
    graphs = DecodeGraphs(model)
    replayed = graphs.run(ids, states, view_type)  # a decode forward does not advance num_tokens here ...
    assert graphs.error is None and replayed is not None, graphs.error
    again = graphs.run(ids, states, view_type)  # ... and writes the same rows again: the same logits
    static_ids = torch.zeros(4, dtype=torch.long, device="cuda")
    static_ids[:3] = ids
    meta = view_type.host_metadata(states, (4, 8)).cuda()
    eager = graphs._forward(static_ids, meta, states, (4, 8), view_type)[:3]
    assert torch.equal(replayed, again) and torch.equal(replayed, eager)
