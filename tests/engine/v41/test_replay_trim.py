"""Trimmed bounded replay (decoder side): on a replay prefill the layers above the last KV
source run only on the prompt's last 128 rows, from T = max(H - 128, L - 128) (engine/kv/manager.py,
engine/models/v41/sub_batch.py).

What is exact, and tested as such: the layers up to the last KV source compute every row as an
untrimmed replay does (so the compressed pages and the lower windows are the same), and so does the
first upper layer on the last row, whose window [L - 128, L) lies entirely in the kept rows. Nothing
else is: the other kept rows see windows cut at T, and the layers after the first upper one read
their keys. So the last token's logits equal the untrimmed replay's only with one upper layer (the
7-layer variant below), and the boundary states of the trimmed prefill stay out of the prefix cache.

Comparisons of runs with different row counts switch the cache rounding off (`no_rounding`): a
matmul of other shape differs in the last bits, which now and then flips an fp8/fp4 rounding
(tests/engine/models/v41/test_model_v41.py explains it); what they check, which rows and keys each layer
sees, does not depend on it.
"""

from __future__ import annotations

import pytest
import torch

from engine.engine_core import EngineConfig, EngineCore, EngineRequest
from engine.kv.manager import KVCache
from engine.loading import load_model
from engine.scheduler.sequence import Sequence
from engine.models.v41.random_init import read_raw_config, write_random_v41_model_dir
from messages.common import SamplingParams
from tests.engine.references import TEST_VOCAB, greedy_params, make_prompt, run_engine
from tests.engine.test_handoff import step_until

HIT, LENGTH = 256, 356  # replay start 128, trim point T = 228: 100 rows trimmed, 128 kept
START, TRIM = HIT - 128, LENGTH - 128
TIGHT = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_v41_model_dir("tiny-v41", tmp_path_factory.mktemp("trim") / "tiny-v41", seed=0,
                                      vocab_size=TEST_VOCAB)


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def one_upper_model(tmp_path_factory):
    """tiny-v41 cut to 7 layers: one layer above the last KV source (5), with Engram there too."""
    raw = read_raw_config("tiny-v41")
    raw["text_config"].update(num_hidden_layers=7, compress_ratios=[0, 0, 2, 2, 2, 1, 1],
                              index_source_layer_ids=[2, 4, 5], engram_layer_ids=[1, 6])
    path = write_random_v41_model_dir(raw, tmp_path_factory.mktemp("trim7") / "tiny-v41-7", seed=1,
                                      vocab_size=TEST_VOCAB)
    return load_model(path, dtype=torch.float32)


@pytest.fixture
def no_rounding(monkeypatch):
    for module in ("engine.models.v41.attention", "engine.models.v41.indexer"):
        monkeypatch.setattr(f"{module}.round_cache", lambda values, point: values)


def _seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, list(tokens), len(tokens), SamplingParams(), "trim-test")


def _ids(tokens) -> torch.Tensor:
    return torch.tensor(list(tokens), dtype=torch.long)


def replay_kv(model, prompt: list[int], trim: bool, slots: int = 1) -> KVCache:
    """A KV cache holding the first HIT tokens' pages of `prompt`, their window states expired."""
    kv = KVCache(model.config, 16, slots, model.device, model.dtype, replay_trim=trim)
    first = _seq("cached", prompt[:HIT])
    kv.admit(first, kv.find_hit(first), HIT)
    model([_ids(prompt[:HIT])], [first.state], captures=[kv.capture_positions(first, HIT)])
    first.num_computed = HIT
    kv.commit(first)
    kv.release(first)
    kv.boundaries.states.clear()
    kv.boundaries.used_bytes = 0
    return kv


def admit_replay(kv: KVCache, prompt: list[int], rid: str = "replayed") -> Sequence:
    """Admit `prompt` on its replay hit, its window rings filled with NaN: a read of any row the
    replay did not write (below the replay start, or below T in an upper layer) spoils the logits."""
    seq = _seq(rid, prompt)
    hit = kv.find_hit(seq)
    assert (hit.tokens, hit.replay_end) == (START, HIT)
    kv.admit(seq, hit, len(prompt) - hit.tokens)
    kv.slots.rings[seq.state.slot].fill_(float("nan"))
    return seq


class Recorder:
    """Each block's input and output streams, per forward (forward hooks)."""

    def __init__(self, model):
        self.inputs, self.outputs = {}, {}
        self.hooks = [block.register_forward_hook(self._hook(i)) for i, block in enumerate(model.layers)]

    def _hook(self, layer):
        def record(module, args, output):
            self.inputs.setdefault(layer, []).append(args[0].clone())
            self.outputs.setdefault(layer, []).append(output[0].clone())
        return record

    def remove(self):
        for hook in self.hooks:
            hook.remove()


def _recorded_replay(model, prompt, trim: bool):
    kv = replay_kv(model, prompt, trim)
    seq = admit_replay(kv, prompt)
    recorder = Recorder(model)
    try:
        logits = model([_ids(prompt[START:])], [seq.state], all_logits=True)
    finally:
        recorder.remove()
    return kv, seq, recorder, logits


def test_upper_layers_run_on_the_last_rows_and_the_lower_layers_are_unchanged(model, no_rounding):
    prompt = make_prompt(LENGTH, 3).tolist()
    last = model.config.last_kv_source
    kv_t, seq_t, trimmed, logits_t = _recorded_replay(model, prompt, trim=True)
    kv_u, seq_u, plain, logits_u = _recorded_replay(model, prompt, trim=False)
    assert seq_t.state.trim_from == TRIM and seq_u.state.trim_from == 0

    for layer in range(last + 1):  # every replayed row, bit for bit
        assert torch.equal(trimmed.outputs[layer][0], plain.outputs[layer][0]), layer
    kept = slice(TRIM - START, None)
    for layer in range(last + 1, model.config.num_layers):  # only the last 128 rows
        assert trimmed.inputs[layer][0].shape[0] == LENGTH - TRIM == 128
    assert torch.equal(trimmed.inputs[last + 1][0], plain.inputs[last + 1][0][kept])
    # the first upper layer's last row sees the same window; its first kept row a window cut at T
    first_upper_t, first_upper_u = trimmed.outputs[last + 1][0], plain.outputs[last + 1][0][kept]
    assert torch.allclose(first_upper_t[-1], first_upper_u[-1], rtol=TIGHT, atol=TIGHT)
    assert not torch.allclose(first_upper_t[0], first_upper_u[0], rtol=1e-3, atol=1e-3)

    # logits: the kept rows only; the compressed pages and the lower windows as without trim
    assert torch.isfinite(logits_t).all() and torch.isfinite(logits_u).all()  # no unwritten window row read
    has_logits = logits_t.abs().sum(-1) > 0
    assert has_logits.tolist() == [p >= TRIM for p in range(START, LENGTH)]
    assert torch.equal(kv_t.pool.read_pages(seq_t.state.page_table), kv_u.pool.read_pages(seq_u.state.page_table))
    for layer in range(model.config.num_layers):
        window_t = kv_t.slots.read(seq_t.state.slot, layer, LENGTH)
        assert window_t.shape[0] == 128
        if layer <= last:
            assert torch.equal(window_t, kv_u.slots.read(seq_u.state.slot, layer, LENGTH)), layer


def test_with_one_upper_layer_the_last_token_is_what_an_untrimmed_replay_gives(one_upper_model, no_rounding):
    model = one_upper_model
    assert model.config.last_kv_source == model.config.num_layers - 2 and model.config.num_layers - 1 in \
        model.config.engram_layer_ids
    prompt = make_prompt(LENGTH, 4).tolist()
    last_rows = []
    for trim in (True, False):
        kv = replay_kv(model, prompt, trim)
        seq = admit_replay(kv, prompt)
        last_rows.append(model([_ids(prompt[START:])], [seq.state])[0])
    full = model([_ids(prompt)], [model.new_state()])[0]
    assert torch.allclose(last_rows[0], last_rows[1], rtol=TIGHT, atol=TIGHT * last_rows[1].abs().max())
    assert not torch.allclose(last_rows[0], full, rtol=1e-3, atol=1e-3)  # replay itself is approximate


def test_a_chunked_trimmed_replay_equals_the_one_shot_one(model, no_rounding):
    prompt = make_prompt(LENGTH, 5).tolist()
    upper = model.config.last_kv_source + 1
    kv1 = replay_kv(model, prompt, trim=True)
    one = admit_replay(kv1, prompt)
    whole = model([_ids(prompt[START:])], [one.state], all_logits=True)

    kv2 = replay_kv(model, prompt, trim=True)
    chunked = admit_replay(kv2, prompt)
    cuts = [START, START + 60, START + 130, LENGTH]  # all trimmed; straddling T; all kept
    with pytest.raises(ValueError, match="trimmed replay rows cannot capture"):  # its upper windows are cut
        model([_ids(prompt[START : START + 60])], [chunked.state], captures=[(START + 32,)])
    assert chunked.state.num_tokens == START
    recorder, pieces = Recorder(model), []
    try:
        for lo, hi in zip(cuts, cuts[1:]):
            pieces.append(model([_ids(prompt[lo:hi])], [chunked.state], all_logits=True))
    finally:
        recorder.remove()
    assert [x.shape[0] for x in recorder.inputs[upper]] == [START + 130 - TRIM, LENGTH - START - 130]
    assert len(recorder.inputs[upper - 1]) == 3  # the lower layers ran every chunk
    pieced = torch.cat(pieces)
    assert torch.equal(pieced.abs().sum(-1) > 0, whole.abs().sum(-1) > 0)
    assert torch.allclose(pieced, whole, rtol=TIGHT, atol=TIGHT * whole.abs().max())
    for layer in range(model.config.num_layers):
        a, b = (kv.slots.read(s.state.slot, layer, LENGTH) for kv, s in ((kv1, one), (kv2, chunked)))
        assert torch.allclose(a, b, rtol=TIGHT, atol=TIGHT), layer


def test_a_packed_batch_of_replay_prefill_and_decode_equals_each_alone(one_upper_model, no_rounding):
    """One forward: a decoding sequence, a trimmed replay chunk straddling T, an ordinary prefill."""
    model = one_upper_model
    replayed, decoding, fresh = (make_prompt(n, seed).tolist() for n, seed in ((LENGTH, 6), (150, 7), (40, 8)))

    def setup():
        kv = replay_kv(model, replayed, trim=True, slots=3)
        seqs = [_seq("decoding", decoding), admit_replay(kv, replayed), _seq("fresh", fresh)]
        for seq in (seqs[0], seqs[2]):
            kv.admit(seq, kv.find_hit(seq), len(seq.token_ids) + 1)
        model([_ids(decoding[:-1])], [seqs[0].state])
        model([_ids(replayed[START:TRIM - 20])], [seqs[1].state])  # the replay's first chunk: all trimmed
        return kv, seqs

    chunks = [_ids(decoding[-1:]), _ids(replayed[TRIM - 20 :]), _ids(fresh)]
    kv_a, packed = setup()
    together = model(chunks, [s.state for s in packed], all_logits=True)
    kv_b, alone = setup()
    apart = torch.cat([model([c], [s.state], all_logits=True) for c, s in zip(chunks, alone)])
    assert together.shape[0] == 1 + LENGTH - TRIM + 20 + 40
    assert int((together.abs().sum(-1) == 0).sum()) == 20  # the trimmed rows
    assert torch.allclose(together, apart, rtol=TIGHT, atol=TIGHT * apart.abs().max())
    for s_a, s_b in zip(packed, alone):
        for layer in range(model.config.num_layers):
            a = kv_a.slots.read(s_a.state.slot, layer, s_a.state.num_tokens)
            assert torch.allclose(a, kv_b.slots.read(s_b.state.slot, layer, s_b.state.num_tokens),
                                  rtol=TIGHT, atol=TIGHT), layer


def _engine(model_dir, **overrides) -> EngineCore:
    return EngineCore(EngineConfig(model_dir=str(model_dir), dtype="float32", num_pages=64, max_num_seqs=4,
                                   **overrides))


def _replaying_engine(model_dir, prompt, **overrides) -> EngineCore:
    """An engine that computed `prompt` once and then lost every window state (a replay hit next)."""
    core = _engine(model_dir, **overrides)
    core.add_request(EngineRequest("first", prompt, greedy_params(1)))
    run_engine(core)
    core.kv.boundaries.states.clear()
    core.kv.boundaries.used_bytes = 0
    return core


@pytest.mark.parametrize("length", [LENGTH, 384], ids=["off-boundary", "prompt-ends-at-a-boundary"])
def test_a_trimmed_replay_saves_no_boundary_state_and_registers_its_pages(model_dir, length):
    prompt = make_prompt(length, 9).tolist()
    boundaries = [b for b in range(128, length + 1, 128) if b > START]  # the replay prefill reaches these
    for trim in (True, False):
        core = _replaying_engine(model_dir, prompt, replay_trim=trim)
        core.add_request(EngineRequest("again", prompt, greedy_params(40)))
        step_until(core, "again", length)
        seq = core.requests["again"]
        assert seq.num_cached_tokens == START and seq.state.trim_from == (max(START, length - 128) if trim else 0)
        saved = [b for b in boundaries if seq.block_hashes[b // 128 - 1] in core.kv.boundaries]
        assert saved == ([] if trim else boundaries), trim
        assert all(h in core.kv.blocks.hash_to_page for h in seq.block_hashes[: length // 128])
        run_engine(core)
        if length == LENGTH:  # decode reaches 384: that boundary's windows are complete, and saved
            assert seq.block_hashes[384 // 128 - 1] in core.kv.boundaries


def test_decode_after_a_trimmed_replay_continues_the_manual_replay(model_dir, model):
    prompt, new = make_prompt(LENGTH, 10).tolist(), 6
    core = _replaying_engine(model_dir, prompt)
    core.add_request(EngineRequest("again", prompt, greedy_params(new + 1)))  # still running after `new`
    produced = step_until(core, "again", LENGTH + new - 1)
    state = core.requests["again"].state
    assert len(produced) == new and (state.trim_from, state.trim_end) == (TRIM, LENGTH)

    # the same replay by hand, then greedy decode: the engine did exactly this
    kv = replay_kv(model, prompt, trim=True)
    seq = admit_replay(kv, prompt)
    token = int(model([_ids(prompt[START:])], [seq.state])[0].argmax())
    tokens = [token]
    for _ in range(new - 1):
        token = int(model([_ids([token])], [seq.state])[0].argmax())
        tokens.append(token)
    assert produced == tokens
    position = LENGTH + new - 1
    for layer in range(model.config.num_layers):  # every window complete: 128 rows, all written
        engine_window = core.kv.slots.read(state.slot, layer, position)
        assert engine_window.shape[0] == 128
        assert torch.equal(engine_window, kv.slots.read(seq.state.slot, layer, position)), layer


def test_an_exact_prefix_request_takes_no_replay_hit(model):
    """A resumed request (EngineRequest.exact_prefix) must continue exactly, so the approximate
    replay hit is not offered: with no window state saved anywhere, it prefills from the start."""
    prompt = make_prompt(LENGTH, 0).tolist()
    kv = replay_kv(model, prompt, trim=True)
    assert kv.find_hit(_seq("replays", prompt)).replay_end == HIT
    exact = _seq("exact", prompt)
    exact.exact_prefix = True
    hit = kv.find_hit(exact)
    assert (hit.tokens, hit.replay_end, hit.pages) == (0, 0, ())
