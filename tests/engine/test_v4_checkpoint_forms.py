"""V4 checkpoints as users have them, against transformers' DeepseekV4 (the V4 reference): tensors
stored in float32, bfloat16 or float16 load cast; quantized tensors and scales are refused naming
the tensor; every config field the reference reads is honoured or refused naming the field."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.models.v4 import load_model
from engine.models.v4.config import ModelConfig, read_config_dict
from tests.engine.references import make_prompt, rel_err

# transformers' DeepseekV4Config fields: read by its model and honoured by ours (parsed, or a
# value ours computes the same way), refused unless at the one value we implement, or not read
# by its model for inference (training, initialisation, the MTP layer it does not build either).
HONOURED = {
    "vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads", "head_dim",
    "q_lora_rank", "num_experts_per_tok", "n_routed_experts", "scoring_func", "routed_scaling_factor",
    "max_position_embeddings", "rope_theta", "layer_types", "compress_rates", "compress_rope_theta", "hc_mult",
    "hc_sinkhorn_iters", "hc_eps", "mlp_layer_types", "swiglu_limit", "sliding_window", "o_groups", "o_lora_rank",
    "index_n_heads", "index_head_dim", "index_topk", "rms_norm_eps", "bos_token_id", "eos_token_id",
    "tie_word_embeddings", "rope_parameters", "partial_rotary_factor",
}
REFUSED = {"hidden_act": "gelu", "mlp_bias": True, "norm_topk_prob": False}
NOT_FOR_INFERENCE = {
    "num_key_value_heads", "n_shared_experts", "attention_bias", "attention_dropout", "initializer_range",
    "num_nextn_predict_layers", "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "use_cache",
    "pad_token_id",
}


def test_every_field_of_the_reference_config_is_honoured_refused_or_not_for_inference():
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    assert set(DeepseekV4Config.__annotations__) == HONOURED | set(REFUSED) | NOT_FOR_INFERENCE


def _other_values() -> dict:
    raw = read_config_dict("tiny")
    raw.update(routed_scaling_factor=2.0, swiglu_limit=6.0, rms_norm_eps=1e-5, hc_sinkhorn_iters=5, hc_eps=1e-5,
               index_topk=8, sliding_window=64, scoring_func="sigmoid", rope_theta=5000.0, compress_rope_theta=9e4,
               partial_rotary_factor=0.5, eos_token_id=3, mlp_layer_types=None, num_hash_layers=1)
    return raw


# our ModelConfig's value of each honoured field, as transformers' config holds it
OURS = {
    "num_hidden_layers": lambda c: c.num_layers, "num_attention_heads": lambda c: c.num_heads,
    "num_experts_per_tok": lambda c: c.experts_per_token, "rope_theta": lambda c: c.main_rope.theta,
    "compress_rope_theta": lambda c: c.compress_rope.theta, "layer_types": lambda c: list(c.layer_types),
    "mlp_layer_types": lambda c: list(c.mlp_layer_types), "partial_rotary_factor": lambda c: c.rope_dim / c.head_dim,
}


@pytest.mark.parametrize("raw", [read_config_dict("tiny"), _other_values(), {}], ids=["tiny", "other", "defaults"])
def test_honoured_fields_parse_to_the_references_values(raw):
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    if not raw:   # every size left out; a schedule is required (ours refuses a config without one)
        raw = {"layer_types": DeepseekV4Config().layer_types}
    theirs, ours = DeepseekV4Config(**json.loads(json.dumps(raw))), ModelConfig.from_dict(raw)
    for field in sorted(HONOURED - {"rope_parameters"}):   # rope: through logits, test_reference_equivalence
        assert OURS.get(field, lambda c: getattr(c, field))(ours) == getattr(theirs, field), field


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_an_unsupported_value_is_refused_naming_the_field(field):
    raw = {**read_config_dict("tiny"), field: REFUSED[field]}
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_dict(raw)


def test_a_quantization_config_is_refused_naming_it():
    raw = {**read_config_dict("tiny"), "quantization_config": {"quant_method": "fp8"}}
    with pytest.raises(ValueError, match="quantization_config"):
        ModelConfig.from_dict(raw)


def test_intermediate_size_is_read_as_moe_intermediate_size_as_the_reference_does():
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    raw = {k: v for k, v in read_config_dict("tiny").items() if k not in ("moe_intermediate_size", "n_routed_experts")}
    raw.update(intermediate_size=96, num_local_experts=4)
    ours, theirs = ModelConfig.from_dict(raw), DeepseekV4Config(**raw)
    assert (ours.moe_intermediate_size, ours.n_routed_experts) == (theirs.moe_intermediate_size,
                                                                   theirs.n_routed_experts) == (96, 4)
    with pytest.raises(ValueError, match="intermediate_size"):
        ModelConfig.from_dict({**raw, "moe_intermediate_size": 128})


def _restored(tiny_dir, tmp_path, edit) -> object:
    out = shutil.copytree(tiny_dir(0), tmp_path / "model")
    path = out / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return out


def _embed_key(tensors) -> str:
    return next(k for k in tensors if k.endswith(("embed.weight", "embed_tokens.weight")))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_tensor_stored_in_another_float_dtype_loads_cast_with_the_references_logits(tiny_dir, tmp_path, dtype):
    import transformers

    def lower(tensors):
        tensors[_embed_key(tensors)] = tensors[_embed_key(tensors)].to(dtype)

    out = _restored(tiny_dir, tmp_path, lower)
    ours = load_model(out, dtype=torch.float32)
    reference = transformers.DeepseekV4ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert ours.model.embed_tokens.weight.dtype == torch.float32
    prompt = make_prompt(60, 0)
    with torch.no_grad():
        logits = ours([prompt], [ours.new_state()], all_logits=True)
        expected = reference(prompt[None], use_cache=False).logits[0]
    assert rel_err(expected, logits) <= 1e-4


def test_a_quantized_tensor_is_refused_naming_it(tiny_dir, tmp_path):
    key = []

    def quantize(tensors):
        key.append(_embed_key(tensors))
        tensors[key[0]] = tensors[key[0]].to(torch.float8_e4m3fn)

    out = _restored(tiny_dir, tmp_path, quantize)
    with pytest.raises(ValueError, match=key[0].replace(".", r"\.")):
        load_model(out)


def test_a_quantization_scale_is_refused_naming_it(tiny_dir, tmp_path):
    out = _restored(tiny_dir, tmp_path, lambda t: t.update({"layers.0.attn.wq_a.scale": torch.ones(2, 2)}))
    with pytest.raises(KeyError, match=r"layers\.0\.attn\.wq_a\.scale"):
        load_model(out)


def test_tied_embeddings_with_a_different_stored_head_are_refused(tiny_dir, tmp_path):
    out = _restored(tiny_dir, tmp_path, lambda tensors: None)
    raw = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, "tie_word_embeddings": True}))
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        load_model(out)
