"""Our V4.1 text model against NeMo Automodel 0.7.0's `DeepseekV41ForCausalLM` (CPU, fp32), and
against itself: chunked prefill, token-by-token decode and batches give what one forward gives.

Configs: `tiny-v41-b` (every layer compressed: ratio-2 sources at 0 and 2, ratio-1 sources at 4
and 6, reindex layers 1, 5 and 7, candidate source 6) with its window cut to 16 and its vocabulary
to 2048, so short prompts cross many window, compression-group and candidate-block boundaries;
and `tiny-v41` (SWA layers, Engram at layers 1 and 2 with the real tokenizer, window 128).

Two regimes, because of the cache rounding (fp8 / fp4 round trips at the points the release
quantizes its caches):
- As released (rounding on): one whole-sequence forward of ours against NeMo's, on prompts that
  survive `screen_prompt` (NeMo's logits stay put when its quantizer inputs move by 1e-6). The two
  agree to ~1e-6 (their routed-expert matmuls differ in layout, and the ~3e-7 difference grows to
  ~2e-6 of a row's RMS at the quantizer inputs); a tiny value that close to an fp4/fp8 rounding
  boundary still flips now and then (measured: 2 of 39 screened prompts, 1e-4 to 1e-3), so the
  tests take the first screened prompt of fixed seeds. In bf16 the two are bit-identical.
- Without cache rounding (both models patched): chunked prefill, decode steps and batches against
  a whole forward and against NeMo. These change the shapes of the fp32 matmuls (a CPU GEMM of 5
  rows or 1 row differs from one of 30 rows by ~2e-6 relative), which flips some rounded cache
  value in a good share of sequences (measured: a 5-token chunking of 30-70-token prompts in 6-9
  of 20; a 24-step decode in 1 of 9 screened sequences), and a flip moves logits by 1e-3 or more.
  The rounding is a per-token function of each cache vector, so what these tests check (which
  tokens, entries and keys each query sees, what the state keeps) does not depend on it.
"""

from __future__ import annotations

import copy

import pytest
import torch

from engine.models.v41 import indexer
from engine.models.v41.cache_rounding import COMPRESSED_KV, INDEX_QK, SWA_KV, round_cache
from engine.models.v41.checkpoint import released_tensor_specs
from engine.models.v41.config import load_v41_config
from engine.models.v41.model import DeepseekV41
from tests.engine.references import rel_err
from tests.helpers.test_helper_nemo_v41 import (
    NEMO_MISSING,
    build_nemo_model,
    nemo_available,
    nemo_logits,
    nemo_released_state_dict,
    perturbed_cache_quantizer,
    raw_v41_config,
    screen_prompt,
)

pytestmark = pytest.mark.skipif(not nemo_available(), reason=NEMO_MISSING)

TOLERANCE = 1e-4  # max |logit difference| / max |reference logit|, against NeMo with cache rounding
TIGHT = 1e-5  # the same, without cache rounding (ours against ours or against NeMo)
VOCAB = 2048
WINDOW = 16


def _raw_b() -> dict:
    raw = raw_v41_config("tiny-v41-b")
    # 32 indexer heads as released: with 8, all heads' ReLU(q.k) are often 0 together, and equal
    # zero scores at the top-k boundary leave the choice to torch.topk's unspecified tie order
    raw["text_config"].update(sliding_window=WINDOW, vocab_size=VOCAB, index_n_heads=32)
    return raw


def _ours_from(nemo, raw: dict, engram_hash=None) -> DeepseekV41:
    released = nemo_released_state_dict(nemo)
    model = DeepseekV41(load_v41_config(raw), engram_hash=engram_hash)
    for name in [n for n in released if n.endswith("engram.embed.weight")]:  # tables are not parameters
        model.layers[int(name.split(".")[1])].engram.load_table(released.pop(name))
    model.load_state_dict(released, strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def models():
    raw = _raw_b()
    nemo = build_nemo_model(raw, seed=0)
    return nemo, _ours_from(nemo, raw)


@pytest.fixture
def unrounded_caches(monkeypatch):
    """Both models without the cache round trips."""
    from nemo_automodel.components.models.deepseek_v41 import attention as nemo_attention

    monkeypatch.setattr(nemo_attention, "quantize_cache", lambda values, format, block_size: values)
    monkeypatch.setattr("engine.models.v41.attention.round_cache", lambda values, point: values)
    monkeypatch.setattr("engine.models.v41.indexer.round_cache", lambda values, point: values)


def _prompt(length: int, seed: int, vocab: int = VOCAB, skip: int = -1) -> list[int]:
    ids = torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(1000 * seed + length))
    return [t for t in ids.tolist() if t != skip]


def _screened(nemo, prompts):
    """The first of the prompts whose NeMo logits survive screening (its `Screen`)."""
    for ids in prompts:
        screen = screen_prompt(nemo, ids)
        if screen.kept:
            return screen
    raise AssertionError("no prompt survived screening")


def _greedy(model, state, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Prefill, then decode one token at a time: (tokens, logits [steps, vocab] they came from)."""
    rows = [model([torch.tensor(prompt)], [state])[0]]
    tokens = [int(rows[0].argmax())]
    for _ in range(steps - 1):
        rows.append(model([torch.tensor(tokens[-1:])], [state])[0])
        tokens.append(int(rows[-1].argmax()))
    return tokens, torch.stack(rows)


def _chunked(model, prompt: list[int], sizes) -> torch.Tensor:
    """All logits of `prompt` prefilled in pieces of the given sizes (cycled)."""
    state, pieces, start, i = model.new_state(), [], 0, 0
    while start < len(prompt):
        size = sizes[i % len(sizes)]
        pieces.append(model([torch.tensor(prompt[start : start + size])], [state], all_logits=True))
        start, i = start + size, i + 1
    assert state.num_tokens == len(prompt)
    return torch.cat(pieces)


# ---- as released (cache rounding on)


def test_parameter_names_are_the_released_checkpoint_names(models):
    nemo, ours = models
    names = set(ours.state_dict())
    assert names == set(nemo_released_state_dict(nemo))
    assert names == set(released_tensor_specs(ours.config))


def test_cache_rounding_is_nemos_bit_for_bit():
    from nemo_automodel.components.models.deepseek_v41.quantization import quantize_cache

    g = torch.Generator().manual_seed(0)
    values = torch.randn(64, 96, generator=g) * torch.logspace(-7, 4, 64)[:, None]
    values[0, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)  # exact fp4 ties
    for point, name in ((SWA_KV, "fp8"), (COMPRESSED_KV, "nvfp4"), (INDEX_QK, "mxfp4")):
        for x in (values, values.bfloat16(), values[:, :40]):
            assert torch.equal(round_cache(x, point), quantize_cache(x, format=name, block_size=point[1]))


@pytest.mark.parametrize("length", [1, 15, 16, 17, 33, 47, 70, 130])
def test_prompt_logits_match_nemo(models, length):
    nemo, ours = models
    screen = _screened(nemo, (_prompt(length, seed) for seed in range(12)))
    logits = ours([torch.tensor(screen.ids)], [ours.new_state()], all_logits=True)
    assert rel_err(screen.logits, logits) <= TOLERANCE


def _nemo_logits_with_images(nemo, ids: list[int], image_mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        hidden, _ = nemo.model(torch.tensor([ids]), image_mask=image_mask[None])
        return nemo.lm_head(hidden)[0].float()


def test_image_tokens_route_with_bias_vl_as_nemo(models):
    nemo, ours = models
    mask = torch.zeros(40, dtype=torch.bool)
    mask[5:21] = True
    for seed in range(12):  # screened as `screen_prompt` does, with the image mask
        ids = _prompt(40, seed)
        reference = _nemo_logits_with_images(nemo, ids, mask)
        moved = 0.0
        for direction in (1.0, -1.0):
            with perturbed_cache_quantizer(direction * 1e-6):
                moved = max(moved, rel_err(reference, _nemo_logits_with_images(nemo, ids, mask)))
        if moved <= 1e-6:
            break
    else:
        raise AssertionError("no prompt survived screening")
    text = ours([torch.tensor(ids)], [ours.new_state()], all_logits=True)
    image = ours([torch.tensor(ids)], [ours.new_state()], all_logits=True, image_masks=[mask])
    assert rel_err(reference, image) <= TOLERANCE
    assert rel_err(text[:5], image[:5]) <= TIGHT  # causal: before the first image token
    assert rel_err(text, image) > 1e-3  # bias_vl really routes the image tokens elsewhere


def _nemo_in_bfloat16(nemo):
    """NeMo's model as it runs in bf16: every floating tensor bf16 but those it keeps in fp32."""
    model = copy.deepcopy(nemo)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point() and not any(k in name for k in model._keep_in_fp32_modules_strict):
            tensor.data = tensor.data.to(torch.bfloat16)
    return model


def test_bfloat16_matches_nemo_in_bfloat16(models, monkeypatch):
    """Same ops on the same shapes: bit-identical, as long as no top-k choice hangs on a tie (bf16
    scores tie often; torch.topk's order among equal scores is unspecified, ours takes the lower
    entry first), so the prompt is one without ties at a top-k boundary."""
    nemo, ours = models
    ours16 = copy.deepcopy(ours).cast(torch.bfloat16)
    assert ours16.layers[0].attn.wq_a.weight.dtype == torch.bfloat16
    assert ours16.layers[0].hc_attn_fn.dtype == ours16.head.weight.dtype == torch.float32
    ties, top_k_mask = [], indexer.top_k_mask

    def watched(scores, k):
        if scores.shape[-1] > k:
            ranked = scores.sort(dim=-1, descending=True).values
            ties.append(bool(((ranked[:, k - 1] == ranked[:, k]) & (ranked[:, k] > float("-inf"))).any()))
        return top_k_mask(scores, k)

    monkeypatch.setattr("engine.models.v41.attention.top_k_mask", watched)
    for seed in range(12):
        ties.clear()
        ids = _prompt(36, seed)
        logits = ours16([torch.tensor(ids)], [ours16.new_state()], all_logits=True)
        if not any(ties):
            break
    else:
        raise AssertionError("every prompt had a top-k tie")
    assert torch.equal(nemo_logits(_nemo_in_bfloat16(nemo), ids), logits)


# ---- without cache rounding: chunks, decode steps, batches


@pytest.mark.parametrize("length, steps", [(29, 24), (200, 16)])
def test_decode_matches_full_forward_and_nemo_greedy(models, unrounded_caches, length, steps):
    """200 tokens: 12 windows of 16, up to 215 ratio-1 entries (top 16 within 4 candidate blocks)."""
    nemo, ours = models
    prompt = _prompt(length, 0)
    tokens, decoded = _greedy(ours, ours.new_state(), prompt, steps)
    sequence = prompt + tokens[:-1]
    full = ours([torch.tensor(sequence)], [ours.new_state()], all_logits=True)
    reference = nemo_logits(nemo, sequence)
    assert rel_err(reference, full) <= TIGHT
    assert rel_err(full[length - 1 :], decoded) <= TIGHT
    assert reference[length - 1 :].argmax(-1).tolist() == tokens  # the greedy continuation is NeMo's


def test_chunked_prefill_matches_one_shot(models, unrounded_caches):
    nemo, ours = models
    prompt = _prompt(150, 1)
    whole = ours([torch.tensor(prompt)], [ours.new_state()], all_logits=True)
    assert rel_err(nemo_logits(nemo, prompt), whole) <= TIGHT
    for sizes in [(1, 7, 3, 16, 2, 9), (16,), (5,), (33, 1, 1, 100)]:
        assert rel_err(whole, _chunked(ours, prompt, sizes)) <= TIGHT, sizes


def test_batched_sequences_match_separate_runs(models, unrounded_caches):
    _, ours = models
    steps = 6
    prompts = [_prompt(length, 2) for length in (40, 1, 23)]
    separate = [_greedy(ours, ours.new_state(), prompt, steps) for prompt in prompts]

    states = [ours.new_state() for _ in prompts]
    logits = ours([torch.tensor(prompt) for prompt in prompts], states)
    rows, tokens = [[row] for row in logits], [[int(row.argmax())] for row in logits]
    for _ in range(steps - 1):
        logits = ours([torch.tensor(t[-1:]) for t in tokens], states)
        for seq, row in enumerate(logits):
            rows[seq].append(row)
            tokens[seq].append(int(row.argmax()))
    for seq, (expected_tokens, expected_rows) in enumerate(separate):
        assert tokens[seq] == expected_tokens
        assert rel_err(expected_rows, torch.stack(rows[seq])) <= TIGHT
    # a prefill piece and decode steps of other sequences in one call
    mixed_states = [ours.new_state() for _ in prompts]
    for prompt, state in zip(prompts[:2], mixed_states):
        ours([torch.tensor(prompt)], [state])
    mixed = ours([torch.tensor(separate[0][0][:1]), torch.tensor(separate[1][0][:1]), torch.tensor(prompts[2])],
                 mixed_states)
    assert rel_err(torch.stack([separate[0][1][1], separate[1][1][1], separate[2][1][0]]), mixed) <= TIGHT


# ---- Engram


@pytest.fixture(scope="module")
def engram_models():
    from engine.models.v4.random_init import tokenizer_json_path
    from engine.models.v41.engram_hash import NgramHasher
    from engine.models.v41.engram_vocab import compressed_vocab

    raw = raw_v41_config("tiny-v41")
    nemo = build_nemo_model(raw, seed=1)
    vocab = compressed_vocab(tokenizer_json_path())
    hasher = NgramHasher(load_v41_config(raw), vocab.token_map, vocab.size)
    return nemo, _ours_from(nemo, raw, engram_hash=hasher)


def _engram_prompt(ours, seed: int, length: int = 150) -> list[int]:
    return _prompt(length, seed, ours.config.vocab_size, skip=ours.config.image_token_id)


def test_engram_model_matches_nemo(engram_models):
    nemo, ours = engram_models
    assert ours.config.engram_layer_ids == (1, 2) and ours.config.sliding_window == 128
    screen = _screened(nemo, (_engram_prompt(ours, seed) for seed in range(12)))
    logits = ours([torch.tensor(screen.ids)], [ours.new_state()], all_logits=True)
    assert rel_err(screen.logits, logits) <= TOLERANCE


def test_engram_chunks_and_decode_match_nemo(engram_models, unrounded_caches):
    nemo, ours = engram_models
    prompt, steps = _engram_prompt(ours, 0), 6
    n = len(prompt)
    tokens, decoded = _greedy(ours, ours.new_state(), prompt, steps)
    reference = nemo_logits(nemo, prompt + tokens[:-1])
    assert rel_err(reference[n - 1 :], decoded) <= TIGHT
    assert reference[n - 1 :].argmax(-1).tolist() == tokens
    whole = ours([torch.tensor(prompt)], [ours.new_state()], all_logits=True)
    assert rel_err(reference[:n], whole) <= TIGHT
    # pieces shorter than the 3-token lookback hash with the ids the state keeps
    state = ours.new_state()
    pieces = [ours([torch.tensor(prompt[a:b])], [state], all_logits=True) for a, b in ((0, 1), (1, 3), (3, 4), (4, n))]
    assert state.recent_ids == prompt[-3:]
    assert rel_err(whole, torch.cat(pieces)) <= TIGHT
