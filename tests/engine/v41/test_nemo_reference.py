"""The NeMo V4.1 reference harness itself: the tiny configs, the seeded weights, the forward, screening."""

from __future__ import annotations

import pytest
import torch

from engine.models.v41.config import REINDEX, REUSE, SOURCE, SWA, load_v41_config
from tests.helpers import test_helper_nemo_v41 as nemo

pytestmark = pytest.mark.skipif(not nemo.nemo_available(), reason=nemo.NEMO_MISSING)

CONFIGS = ("tiny-v41", "tiny-v41-b")


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(3, 128000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def models():
    return {name: nemo.build_nemo_model(name, seed=0) for name in CONFIGS}


@pytest.mark.parametrize("name", CONFIGS)
def test_config_parses_the_same_in_ours_and_nemo(name):
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config

    raw = nemo.raw_v41_config(name)
    ours, theirs = load_v41_config(name), DeepseekV41Config(**raw)
    text = theirs.text_config
    assert raw["model_type"] == "deepseek_v41" and theirs.image_token_id == ours.image_token_id == 129264
    vision = theirs.vision_config
    assert (ours.vision.num_layers, ours.vision.hidden_size, ours.vision.num_heads, ours.vision.intermediate_size,
            ours.vision.max_image_tokens, ours.vision.min_pixels) == (
        vision.num_hidden_layers, vision.hidden_size, vision.num_attention_heads, vision.intermediate_size,
        vision.max_image_tokens, vision.min_pixels)
    assert vision.num_hidden_layers == (2 if name == "tiny-v41" else 0) and text.num_nextn_predict_layers == 0
    assert ours.vocab_size == text.vocab_size == 129280
    assert list(ours.compress_ratios) == text.compress_ratios[: text.num_hidden_layers]
    assert list(ours.kv_source_layer_ids) == text.kv_source_layer_ids
    assert list(ours.index_source_layer_ids) == text.index_source_layer_ids
    assert ours.candidate_source_layer_id == text.candidate_source_layer_id >= 0
    assert list(ours.engram_layer_ids) == text.engram_layer_ids
    assert list(ours.engram_num_embeddings) == text.engram_num_embeddings
    assert ours.rms_norm_eps == text.rms_norm_eps == 1e-20


def test_tiny_v41_covers_every_layer_role():
    config = load_v41_config("tiny-v41")
    roles = {(config.role(i), config.compress_ratios[i], config.uses_candidates(i)) for i in range(config.num_layers)}
    assert {(SWA, 0, False), (SOURCE, 2, False), (REUSE, 2, False), (REINDEX, 2, False)} <= roles
    assert {(SOURCE, 1, False), (REUSE, 1, True), (REINDEX, 1, True)} <= roles
    assert config.candidate_source_layer_id in config.kv_source_layer_ids
    assert len(config.engram_layer_ids) == 2 and max(config.engram_layer_ids) < config.last_kv_source
    second = load_v41_config("tiny-v41-b")
    assert second.engram_layer_ids == () and second.candidate_source_layer_id >= 0
    assert second.kv_source_layer_ids != config.kv_source_layer_ids


def test_engram_sizes_follow_nemos_rules(models):
    """Rows are the sum of each layer's hash primes; the compressed vocab is the real tokenizer's."""
    text_config = models["tiny-v41"].config.text_config
    hashing = models["tiny-v41"].model.engram_hash
    assert hashing.primes.sum(-1).tolist() == list(text_config.engram_num_embeddings)
    assert nemo.engram_compressed_vocab_size() == text_config.engram_compressed_vocab_size == 99092


@pytest.mark.parametrize("name", CONFIGS)
def test_forward_gives_finite_logits(models, name):
    logits = nemo.nemo_logits(models[name], prompt(1, 150))
    assert logits.shape == (150, 129280) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all() and logits.std() > 0.1


def test_weights_are_seeded_random_and_released_names(models):
    weights = nemo.nemo_released_state_dict(models["tiny-v41"])
    assert {"embed.weight", "head.weight", "norm.weight", "layers.0.attn.attn_sink", "layers.2.ffn.gate.bias",
            "layers.2.ffn.gate.bias_vl", "layers.2.hc_attn_base", "layers.2.attn.compressor.wgate.weight",
            "layers.5.attn.indexer.wk.weight", "layers.1.engram.embed.weight", "layers.7.ffn.experts.7.w2.weight"} <= set(weights)
    assert not any(name.startswith("mtp.") or "tid2eid" in name or ".ape" in name for name in weights)
    for name, value in weights.items():
        assert value.dtype == torch.float32 and value.std() > 0, name  # nothing left at a constant
    again = nemo.nemo_released_state_dict(nemo.build_nemo_model("tiny-v41", seed=0))
    assert all(torch.equal(weights[name], again[name]) for name in weights)
    other = nemo.build_nemo_model("tiny-v41", seed=1)
    assert not torch.equal(other.lm_head.weight, models["tiny-v41"].lm_head.weight)


def test_weights_sit_on_their_released_grids(models):
    """Encoded the released way and decoded by NeMo's own checkpoint decoder, they come back exactly."""
    from nemo_automodel.components.models.deepseek_v41.state_dict_adapter import dequantize_checkpoint_weight

    weights = nemo.nemo_released_state_dict(models["tiny-v41"])
    for name in ("layers.2.attn.wq_b.weight", "layers.5.ffn.shared_experts.w2.weight", "layers.1.engram.wkv.weight"):
        assert nemo.released_format(name) == nemo.FP8_BLOCK32
        weight, scale = encode_fp8(weights[name], 32)
        assert torch.equal(dequantize_checkpoint_weight(weight, scale, dtype=torch.float32), weights[name]), name
    name = "layers.2.engram.embed.weight"
    assert nemo.released_format(name) == nemo.FP8_ROW32
    weight, scale = encode_fp8(weights[name], 1)
    assert torch.equal(dequantize_checkpoint_weight(weight, scale, dtype=torch.float32, rowwise=True), weights[name])
    for name in ("layers.3.ffn.experts.5.w1.weight", "layers.6.ffn.experts.0.w2.weight"):
        assert nemo.released_format(name) == nemo.FP4_ROW32
        weight, scale = encode_fp4(weights[name])
        assert torch.equal(dequantize_checkpoint_weight(weight, scale, dtype=torch.float32), weights[name]), name
    for name, fmt in (("embed.weight", nemo.BF16), ("layers.4.attn.indexer.weights_proj.weight", nemo.BF16),
                      ("head.weight", nemo.FP32), ("layers.3.hc_ffn_fn", nemo.FP32)):
        assert nemo.released_format(name) == fmt
        if fmt == nemo.BF16:
            assert torch.equal(weights[name].bfloat16().float(), weights[name])


def encode_fp8(w: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes with power-of-two scales per rows x 32 block (amax / 448, rounded up)."""
    blocks = w.unflatten(1, (-1, 32)).unflatten(0, (-1, rows))
    scale = pow2_ceiling(blocks.abs().amax(dim=(1, 3)).clamp_min(2.0**-100) / 448)
    codes = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).flatten(2).flatten(0, 1)
    return codes, scale.to(torch.float8_e8m0fnu)


def encode_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e2m1 codes, two per byte (even column in the low nibble), per-row power-of-two scales per 32."""
    groups = w.unflatten(1, (-1, 32))
    scale = pow2_ceiling(groups.abs().amax(-1).clamp_min(2.0**-100) / 6)
    magnitude = (groups / scale[..., None]).flatten(1)
    levels = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    index = (magnitude.abs().unsqueeze(-1) == levels).int().argmax(-1)
    assert torch.equal(levels[index], magnitude.abs()), "not on the e2m1 grid"
    codes = (index + 8 * (magnitude < 0)).to(torch.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu)


def pow2_ceiling(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(x)))


def test_prefix_logits_are_the_first_rows_of_longer_logits(models):
    """On a strictly screened prompt (about half of 140-token prompts are): equal to 1e-4."""
    model = models["tiny-v41"]
    screen = next(s for s in (nemo.screen_prompt(model, prompt(seed, 140), strict=True) for seed in range(10, 20))
                  if s.kept)
    for cut in (133, 100):
        prefix = nemo.nemo_logits(model, screen.ids[:cut])
        assert (prefix - screen.logits[:cut]).abs().max() <= 1e-4 * screen.logits.abs().max()


def test_screening_keeps_most_prompts(models):
    """The default screen keeps about 3 in 4 prompts of 96 tokens (and few of 300: see screen_prompt)."""
    candidates = [prompt(seed, 96) for seed in range(20, 26)]
    assert len(nemo.screened_prompts(models["tiny-v41"], candidates)) >= 4


@pytest.mark.parametrize("site", nemo.STRICT_SITES)
def test_each_perturbation_reaches_nemo(models, site):
    """A patch that no longer reaches NeMo's code would screen nothing out: a big nudge must move logits."""
    model = models["tiny-v41"]
    ids = prompt(2, 64)
    plain = nemo.nemo_logits(model, ids)
    with nemo.perturbed_reference(model, 0.05, sites=(site,)):
        nudged = nemo.nemo_logits(model, ids)
    assert (nudged - plain).abs().max() > 1e-5 * plain.abs().max()  # a flip moves them 1e-4 and more
    assert torch.equal(nemo.nemo_logits(model, ids), plain)  # everything restored
