"""Every `config.json` field the reference (NeMo Automodel 0.7.0's DeepSeek V4.1) reads is honoured
the way it honours it, or refused with an error naming the field. `norm_topk_prob: false` is the
case that used to give wrong logits with no error."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

from engine.models.v41.config import load_v41_config
from engine.models.v41.rope import V41Rotary
from tests.engine.references import rel_err
from tests.engine.v41.test_model_v41 import _ours_from, _raw_b
from tests.helpers.test_helper_nemo_v41 import NEMO_MISSING, build_nemo_model, nemo_available, screen_prompt

pytestmark = pytest.mark.skipif(not nemo_available(), reason=NEMO_MISSING)

# Our V41Config attribute for each text_config field the reference's model reads.
HONOURED = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads", "head_dim": "head_dim", "qk_rope_head_dim": "rope_dim",
    "q_lora_rank": "q_lora_rank", "o_lora_rank": "o_lora_rank", "o_groups": "o_groups",
    "moe_intermediate_size": "moe_intermediate_size", "n_routed_experts": "n_routed_experts",
    "num_experts_per_tok": "experts_per_token", "norm_topk_prob": "norm_topk_prob",
    "routed_scaling_factor": "routed_scaling_factor", "swiglu_limit": "swiglu_limit", "rms_norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta", "compress_rope_theta": "compress_rope_theta", "rope_scaling": "rope_scaling",
    "sliding_window": "sliding_window", "compress_ratios": "compress_ratios",
    "kv_source_layer_ids": "kv_source_layer_ids", "index_source_layer_ids": "index_source_layer_ids",
    "index_n_heads": "index_n_heads", "index_head_dim": "index_head_dim", "index_topk": "index_topk",
    "candidate_source_layer_id": "candidate_source_layer_id", "candidate_topk_blocks": "candidate_topk_blocks",
    "candidate_block_size": "candidate_block_size", "hc_mult": "hc_mult", "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "hc_eps": "hc_eps", "engram_layer_ids": "engram_layer_ids", "engram_num_embeddings": "engram_num_embeddings",
    "engram_max_ngram_size": "engram_max_ngram_size", "engram_vocab_size": "engram_vocab_size",
    "engram_n_heads": "engram_n_heads", "engram_head_dim": "engram_head_dim",
    "engram_pad_token_id": "engram_pad_token_id", "engram_compressed_vocab_size": "engram_compressed_vocab_size",
    "dtype": "dtype", "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "pad_token_id": "pad_token_id",
}
ROPE_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
# Fields whose only supported value we check, refusing any other (the reference refuses or ignores the rest).
REFUSED = {"num_key_value_heads": 2, "n_shared_experts": 2, "tie_word_embeddings": True, "scoring_func": "softmax"}
# Read by the reference only outside inference (training, initialisation) or for the DSpark draft,
# which we do not load; or not read by its model at all (topk_method, hidden_act, attention_bias,
# use_cache, max_position_embeddings).
NOT_FOR_INFERENCE = {
    "attention_dropout", "initializer_range", "num_nextn_predict_layers", "dspark_block_size",
    "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank", "dspark_n_routed_experts",
    "dspark_num_experts_per_tok", "topk_method", "hidden_act", "attention_bias", "use_cache",
    "max_position_embeddings",
}


def _text_fields() -> set[str]:
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig

    return set(inspect.signature(DeepseekV41TextConfig.__init__).parameters) - {"self", "kwargs"}


def test_every_text_field_of_the_reference_is_honoured_refused_or_not_for_inference():
    assert _text_fields() == set(HONOURED) | set(REFUSED) | NOT_FOR_INFERENCE


def test_every_top_level_field_of_the_reference_is_honoured_or_refused():
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config

    fields = set(inspect.signature(DeepseekV41Config.__init__).parameters) - {"self", "kwargs"}
    # text_config, vision_config: parsed field by field; the token ids: honoured; tie_word_embeddings:
    # refused when true; dtype: the text model's governs, as in the reference; architectures: a label
    assert fields == {"text_config", "vision_config", "image_token_id", "dtype", "pad_token_id", "bos_token_id",
                      "eos_token_id", "tie_word_embeddings", "architectures"}
    raw = _raw_b()
    raw.update(image_token_id=77, bos_token_id=5, eos_token_id=6, pad_token_id=7)
    ours, theirs = load_v41_config(raw), DeepseekV41Config(**copy.deepcopy(raw))
    assert (ours.image_token_id, ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        theirs.image_token_id, theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (77, 5, 6, 7)


def test_every_vision_field_of_the_reference_is_parsed_to_its_value():
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41VisionConfig

    from engine.models.v41.config import _VISION_KEYS

    assert set(inspect.signature(DeepseekV41VisionConfig.__init__).parameters) - {"self", "kwargs"} == {
        key for key, _, _ in _VISION_KEYS}
    raw = {"num_hidden_layers": 3, "hidden_size": 96, "num_attention_heads": 6, "intermediate_size": 200,
           "patch_size": 7, "rope_theta": 500.0, "downsample_ratio": 2, "max_image_tokens": 64, "min_pixels": 1000,
           "max_wh_ratio": 4.0}
    ours, theirs = load_v41_config({**_raw_b(), "vision_config": raw}).vision, DeepseekV41VisionConfig(**raw)
    for key, attribute, _ in _VISION_KEYS:
        assert getattr(ours, attribute) == getattr(theirs, key), key


def _other_values() -> dict:
    """tiny-v41-b with every honoured field the schedule allows at a value other than the defaults."""
    raw = _raw_b()
    raw["text_config"].update(
        norm_topk_prob=False, routed_scaling_factor=2.5, swiglu_limit=7.0, rms_norm_eps=1e-6, rope_theta=5000.0,
        compress_rope_theta=80000.0, rope_scaling={"factor": 4, "original_max_position_embeddings": 512},
        index_topk=8, candidate_topk_blocks=5, candidate_block_size=4, hc_sinkhorn_iters=7, hc_eps=1e-5,
        engram_max_ngram_size=3, engram_n_heads=4, engram_pad_token_id=5, dtype="float32",
    )
    return raw


@pytest.mark.parametrize("raw", [_raw_b(), _other_values(), {"text_config": {}}], ids=["tiny", "other", "defaults"])
def test_honoured_fields_parse_to_the_references_values(raw):
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config

    theirs, ours = DeepseekV41Config(**copy.deepcopy(raw)).text_config, load_v41_config(raw)
    for field, attribute in HONOURED.items():
        value = getattr(theirs, field)
        if field in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids",
                     "engram_num_embeddings"):
            value = tuple(value[: theirs.num_hidden_layers]) if field == "compress_ratios" else tuple(value)
        if field == "candidate_source_layer_id" and value >= theirs.num_hidden_layers:
            value = -1   # a source past a truncated config: no candidate selection, in both
        if field == "rope_scaling":   # the keys its rotary reads (transformers adds rope_theta to the dict)
            value, mine = ({k: d.get(k) for k in ROPE_KEYS} for d in (value, ours.rope_scaling))
            assert mine == value
            continue
        if field == "dtype":
            value = str(value).removeprefix("torch.")
        assert getattr(ours, attribute) == value, field


@pytest.mark.parametrize("scaling", [None, {}, {"factor": 8, "original_max_position_embeddings": 1024,
                                                "beta_fast": 16, "beta_slow": 2, "rope_type": "yarn"}])
def test_rope_scaling_gives_the_references_compressed_rotary_angles(scaling):
    from nemo_automodel.components.models.deepseek_v41.attention import _RotaryEmbedding
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config

    raw = _raw_b()
    raw["text_config"]["rope_scaling"] = scaling
    theirs = _RotaryEmbedding(DeepseekV41Config(**copy.deepcopy(raw)).text_config, compressed=True)
    config = load_v41_config(raw)
    positions = torch.arange(0, 200_000, 997)
    ours = V41Rotary(config.compress_rope_theta, config.rope_dim, config.rope_scaling).angles(positions)
    assert torch.equal(ours, theirs(positions[None])[0])


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_an_unsupported_value_is_refused_naming_the_field(field):
    raw = _raw_b()
    raw["text_config"][field] = REFUSED[field]
    with pytest.raises(ValueError, match=field):
        load_v41_config(raw)


@pytest.mark.parametrize("key, value", [("quant_method", "awq"), ("weight_block_size", [128, 128]),
                                        ("scale_fmt", "float32")])
def test_a_quantization_config_other_than_the_releases_is_refused_naming_the_key(key, value):
    raw = _raw_b()
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                  "weight_block_size": [32, 32], key: value}
    with pytest.raises(ValueError, match=f"quantization_config.{key}"):
        load_v41_config(raw)


def test_a_top_level_tie_word_embeddings_is_refused_too():
    raw = _raw_b()
    raw["tie_word_embeddings"] = True
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        load_v41_config(raw)


def test_norm_topk_prob_false_gives_the_references_logits():
    raw = _raw_b()
    raw["text_config"]["norm_topk_prob"] = False
    nemo = build_nemo_model(raw, seed=0)
    ours = _ours_from(nemo, raw)
    renormalising = copy.deepcopy(raw)
    renormalising["text_config"]["norm_topk_prob"] = True
    wrong = _ours_from(nemo, renormalising)
    generator = torch.Generator().manual_seed(3)
    prompts = (torch.randint(3, 2048, (40,), generator=generator).tolist() for _ in range(12))
    screen = next(s for s in (screen_prompt(nemo, ids) for ids in prompts) if s.kept)
    with torch.no_grad():
        logits = ours([torch.tensor(screen.ids)], [ours.new_state()], all_logits=True)
        ignored = wrong([torch.tensor(screen.ids)], [wrong.new_state()], all_logits=True)
    assert rel_err(screen.logits, logits) <= 1e-4
    assert rel_err(screen.logits, ignored) > 1e-2   # ignoring the field is wrong from the first token
    assert rel_err(screen.logits[:1], ignored[:1]) > 1e-3
