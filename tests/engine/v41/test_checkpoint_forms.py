"""V4.1 checkpoints as users have them: the released layout, unquantized tensors stored in float32
or bfloat16, and the community BF16 export (every quantized weight decoded by the reference's
decoder, no scales, no quantization_config). Anything else is refused, naming the tensor."""

from __future__ import annotations

import json

import pytest
import torch

from engine.engine_core import EngineConfig, EngineCore, EngineRequest
from engine.loading import load_model
from engine.models.v41.checkpoint import FP32, load_v41_state_dict, released_tensor_specs
from engine.models.v41.config import load_v41_config
from engine.models.v41.random_init import write_random_v41_model_dir
from tests.engine.references import TEST_VOCAB, make_prompt, run_engine
from tests.helpers import test_helper_nemo_v41 as nemo_helper
from tests.helpers.test_helper_bf16_export import copy_model_dir, export_bf16, restore_tensor

needs_nemo = pytest.mark.skipif(not nemo_helper.nemo_available(), reason=nemo_helper.NEMO_MISSING)
NEW_TOKENS = 10
ENGRAM_TABLE = "layers.1.engram.embed.weight"   # tiny-v41: Engram at layers 1 and 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_v41_model_dir("tiny-v41", tmp_path_factory.mktemp("forms") / "released", seed=0,
                                      vocab_size=TEST_VOCAB)


@pytest.fixture(scope="module")
def bf16_dir(model_dir, tmp_path_factory):
    if not nemo_helper.nemo_available():
        pytest.skip(nemo_helper.NEMO_MISSING)
    return export_bf16(model_dir, tmp_path_factory.mktemp("forms") / "bf16")


def _logits(model_dir, ids: list[int]) -> torch.Tensor:
    model = load_model(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model([torch.tensor(ids)], [model.new_state()], all_logits=True)


def _greedy_through_engine(model_dir, dtype: str, weights: str) -> dict[str, tuple[list[int], list[float]]]:
    from messages.common import SamplingParams

    core = EngineCore(EngineConfig(model_dir=str(model_dir), dtype=dtype, weights=weights, num_pages=32,
                                   max_num_seqs=4))
    for length in (7, 150):
        params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)
        core.add_request(EngineRequest(f"r{length}", make_prompt(length, 3).tolist(), params))
    return {rid: (got.tokens, got.logprobs) for rid, got in run_engine(core).items()}


# ---- accepted forms


@needs_nemo
def test_the_bf16_export_has_no_scales_and_no_quantization_config(model_dir, bf16_dir):
    stored = load_v41_state_dict(bf16_dir, keep_engram_fp8=True)
    assert not any(name.endswith(".scale") for name in stored)
    assert stored[ENGRAM_TABLE].dtype == torch.bfloat16   # the Engram table too comes dequantized, alone
    assert "quantization_config" not in json.loads((bf16_dir / "config.json").read_text())
    assert "quantization_config" in json.loads((model_dir / "config.json").read_text())


@needs_nemo
def test_the_bf16_export_decodes_to_the_same_weights_as_the_release(model_dir, bf16_dir):
    released, exported = load_v41_state_dict(model_dir), load_v41_state_dict(bf16_dir)
    assert set(released) == set(exported)
    for name, tensor in released.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


@needs_nemo
@pytest.mark.parametrize("dtype, weights", [("float32", "model"), ("bfloat16", "model"), ("bfloat16", "released")])
def test_the_bf16_export_gives_the_releases_greedy_tokens_and_logprobs(model_dir, bf16_dir, dtype, weights):
    """Served plainly, or re-packed into the release's formats (`weights = "released"`): the export's
    decoded values sit on the release's grids, so they pack back to the same blocks."""
    original = _greedy_through_engine(model_dir, dtype, weights)
    exported = _greedy_through_engine(bf16_dir, dtype, weights)
    assert set(original) == set(exported) == {"r7", "r150"}
    for rid, (tokens, logprobs) in original.items():
        assert exported[rid][0] == tokens, rid
        assert len(logprobs) == NEW_TOKENS
        assert max(abs(a - b) for a, b in zip(exported[rid][1], logprobs)) <= 1e-4, rid


def test_a_float32_stored_embedding_and_norm_load_cast_with_the_same_logits(model_dir, tmp_path):
    stored = load_v41_state_dict(model_dir, dtype=torch.float32)
    out = copy_model_dir(model_dir, tmp_path / "f32")
    restore_tensor(out, {name: stored[name].float() for name in ("embed.weight", "norm.weight")})
    ids = make_prompt(40, 1).tolist()
    assert torch.equal(_logits(out, ids), _logits(model_dir, ids))
    assert load_v41_state_dict(out)["embed.weight"].dtype == torch.bfloat16   # cast to the model dtype


def test_a_bfloat16_stored_float32_tensor_loads_as_float32(model_dir, tmp_path):
    specs = released_tensor_specs(load_v41_config(model_dir))
    assert specs["head.weight"].format == FP32
    head = load_v41_state_dict(model_dir)["head.weight"]
    out = copy_model_dir(model_dir, tmp_path / "bf16head")
    restore_tensor(out, {"head.weight": head.bfloat16()})
    loaded = load_v41_state_dict(out)["head.weight"]
    assert loaded.dtype == torch.float32 and torch.equal(loaded, head.bfloat16().float())


# ---- refused forms, each naming the tensor


def _refused(model_dir, tmp_path, edits: dict, error: type, named: str) -> None:
    out = copy_model_dir(model_dir, tmp_path / "damaged")
    restore_tensor(out, edits)
    with pytest.raises(error, match=named.replace(".", r"\.")):
        load_v41_state_dict(out)


def test_an_unquantized_tensor_in_another_dtype_is_refused_naming_it(model_dir, tmp_path):
    embed = load_v41_state_dict(model_dir)["embed.weight"]
    _refused(model_dir, tmp_path, {"embed.weight": embed.half()}, ValueError, "embed.weight")


def test_a_dequantized_weight_in_the_wrong_shape_is_refused_naming_it(model_dir, tmp_path):
    name = "layers.2.attn.wq_a.weight"
    weight = load_v41_state_dict(model_dir)[name]
    _refused(model_dir, tmp_path, {name: weight.t().contiguous(), "layers.2.attn.wq_a.scale": None},
             ValueError, name)


@pytest.mark.parametrize("weight", ["layers.2.attn.wq_a.weight", "layers.3.ffn.experts.5.w2.weight", ENGRAM_TABLE])
def test_a_quantized_weight_without_its_scale_is_refused_naming_the_scale(model_dir, tmp_path, weight):
    scale = weight.removesuffix(".weight") + ".scale"
    _refused(model_dir, tmp_path, {scale: None}, KeyError, scale)


def test_a_scale_for_a_weight_the_release_does_not_quantize_is_refused_naming_it(model_dir, tmp_path):
    scale = torch.ones(TEST_VOCAB // 32, 4, dtype=torch.float8_e8m0fnu)
    _refused(model_dir, tmp_path, {"embed.scale": scale}, KeyError, "embed.scale")


def test_a_quantized_weight_with_a_scale_but_stored_unquantized_is_refused_naming_it(model_dir, tmp_path):
    name = "layers.2.attn.wq_a.weight"
    weight = load_v41_state_dict(model_dir)[name]
    _refused(model_dir, tmp_path, {name: weight}, ValueError, name)


def test_a_float32_stored_vision_tensor_loads_cast(model_dir, tmp_path):
    from engine.models.v41.checkpoint import iter_vision_state_dict

    original = dict(iter_vision_state_dict(model_dir))["image_end"]
    out = copy_model_dir(model_dir, tmp_path / "f32vision")
    restore_tensor(out, {"image_end": original.float()})
    loaded = dict(iter_vision_state_dict(out))["image_end"]
    assert loaded.dtype == torch.bfloat16 and torch.equal(loaded, original)
