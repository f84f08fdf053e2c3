"""Both model families satisfy the engine's model contract (engine.models.spec), and EngineCore serves
a model it is handed exactly as one it loads."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.engine_core import EngineConfig, EngineCore, EngineRequest
from engine.loading import load_model
from engine.models.common.state import SequenceState
from engine.models.spec import CacheSpec, ModelConfigSpec, ModelSpec, SequenceKV, check_config, check_model
from messages.common import SamplingParams


@pytest.fixture(scope="module")
def v41_model(tiny_v41_model_dir):
    return load_model(tiny_v41_model_dir, dtype="float32")


@pytest.fixture(params=["v4", "v4.1"])
def model(request, tiny_model, v41_model):
    return tiny_model(0) if request.param == "v4" else v41_model


def test_both_families_models_and_configs_satisfy_the_contract(model):
    assert check_model(model) is model and isinstance(model, ModelSpec)
    assert check_config(model.config) is model.config
    assert isinstance(model.config, ModelConfigSpec) and isinstance(model.config, CacheSpec)
    state = model.new_state()
    assert isinstance(state, SequenceKV) and state.decode_view_type is None and state.trim_from == 0


def test_capabilities_match_what_each_family_declares(tiny_model, v41_model):
    v4, v41 = tiny_model(0), v41_model
    assert v4.capabilities.decode_graphs and v4.decode_graphs is not None
    assert not v41.capabilities.decode_graphs and v41.decode_graphs is None
    assert (v4.capabilities.bounded_replay, v41.capabilities.bounded_replay) == (False, True)
    assert v4.config.last_kv_source == -1 and not v4.capabilities.trimmed_replay
    assert v41.config.last_kv_source >= 0 and v41.capabilities.trimmed_replay
    assert (v4.config.image_token_id, v4.capabilities.vision) == (None, False)
    assert v41.capabilities.vision and v41.config.image_token_id is not None
    assert (v4.config.quant_block, v41.config.quant_block) == (128, 32)
    assert v4.config.engram_context == 0


def test_a_contiguous_state_satisfies_the_state_contract_too(tiny_model):
    assert isinstance(SequenceState.empty(tiny_model(0).config), SequenceKV)


def test_what_lacks_part_of_the_contract_is_refused_naming_it(tiny_model):
    with pytest.raises(TypeError, match="capabilities"):
        check_model(torch.nn.Linear(2, 2))

    @dataclasses.dataclass
    class HalfConfig:
        num_layers: int = 1

    with pytest.raises(TypeError, match="compress_ratio"):
        check_config(HalfConfig())


def _greedy(engine: EngineCore, prompt: list[int]) -> list[int]:
    engine.add_request(EngineRequest("r", prompt, SamplingParams(max_tokens=6, temperature=0.0)))
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


@pytest.mark.parametrize("family", ["v4", "v4.1"])
def test_an_engine_handed_a_model_serves_it_as_the_loaded_one(family, tiny_dir, tiny_v41_model_dir):
    model_dir = str(tiny_dir(0) if family == "v4" else tiny_v41_model_dir)
    config = EngineConfig(model_dir=model_dir, dtype="float32", num_pages=16, max_num_seqs=2)
    model = load_model(model_dir, dtype="float32")
    handed, loaded = EngineCore(config, model=model), EngineCore(config)
    assert handed.model is model and handed.model_id == loaded.model_id
    prompt = list(range(3, 40))
    assert _greedy(handed, prompt) == _greedy(loaded, prompt)


def test_a_handed_model_in_another_dtype_or_on_another_device_is_refused(tiny_model, tiny_dir):
    model = tiny_model(0)   # float32 on the CPU
    with pytest.raises(ValueError, match="dtype 'bfloat16'"):
        EngineCore(EngineConfig(model_dir=str(tiny_dir(0)), dtype="bfloat16"), model=model)
    with pytest.raises(ValueError, match="device 'meta'"):
        EngineCore(EngineConfig(model_dir=str(tiny_dir(0)), device="meta"), model=model)
    with pytest.raises(TypeError, match="not a model"):
        EngineCore(EngineConfig(model_dir=str(tiny_dir(0))), model=torch.nn.Linear(2, 2))
