"""`pack_model_`: a model holding MXFP4 experts and FP8 linears computes what the same model with
those weights dequantized computes (the torch path here; the kernels are checked in tests/kernels).

V4: random weights are not on the FP8/MXFP4 grids, so the reference is the packed model's own
weights dequantized back into plain modules. V4.1: a released-format checkpoint is dequantized at
load, so packing it again must be exact: the packed model equals the loaded one.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from engine.models.v4 import load_model
from engine.models.v4.attention import GroupedLinear
from engine.models.v4.generate import greedy_generate, prefill
from engine.models.v4.moe import RoutedExperts
from engine.quant.pack_model import pack_model_, round_to_formats_
from engine.quant.packed_linear import PackedLinear
from engine.models.v41.loader import load_v41_model
from engine.models.v41.random_init import write_random_v41_model_dir
from tests.engine.references import TEST_VOCAB, make_prompt


def unpacked_copy_for_tests(model: nn.Module) -> nn.Module:
    """A deep copy of a packed V4 model with every packed weight dequantized into a plain module."""
    plain = copy.deepcopy(model)
    for name, parent in list(plain.named_modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                if child.groups > 1:
                    linear = GroupedLinear(child.in_features, child.out_features, child.groups)
                else:
                    linear = nn.Linear(child.in_features, child.out_features, bias=False)
                linear.weight = nn.Parameter(child.packed.dequantize(torch.float32))
                setattr(parent, child_name, linear)
        if isinstance(parent, RoutedExperts) and "gate_up_data" in parent._buffers:
            gate_up, down = parent.packed
            for buffer in ("gate_up_data", "gate_up_scale", "down_data", "down_scale"):
                del parent._buffers[buffer]
            parent.gate_up_proj = nn.Parameter(gate_up.dequantize(torch.float32))
            parent.down_proj = nn.Parameter(down.dequantize(torch.float32))
    return plain


def _bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def test_v4_packed_model_matches_its_dequantized_weights(tiny_model):
    model = copy.deepcopy(tiny_model(0))
    before = _bytes(model)
    done = pack_model_(model, experts="mxfp4", linears="fp8")
    assert done["expert_layers"] == len(model.model.layers)
    assert done["linear_layers"] > 0
    assert _bytes(model) < before / 2
    reference = unpacked_copy_for_tests(model)
    prompt = make_prompt(40, seed=3)
    ours, theirs = model.new_state(), reference.new_state()
    got, want = prefill(model, ours, prompt), prefill(reference, theirs, prompt)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert greedy_generate(model, prompt, 6) == greedy_generate(reference, prompt, 6)


def test_v41_repacking_a_released_checkpoint_is_exact(tmp_path):
    model_dir = write_random_v41_model_dir("tiny-v41", tmp_path / "m", seed=0, vocab_size=TEST_VOCAB)
    loaded = load_v41_model(model_dir, dtype=torch.float32)
    packed = copy.deepcopy(loaded)
    done = pack_model_(packed)
    assert done["block"] == 32 and done["expert_layers"] == len(packed.layers)
    assert done["linear_layers"] > 0
    plain = dict(loaded.named_modules())
    for name, module in packed.named_modules():  # the release's grids: re-quantizing loses nothing
        if isinstance(module, PackedLinear):
            assert torch.equal(module.packed.dequantize(torch.float32), plain[name].weight), name
    experts = plain["layers.1.ffn"].experts
    gate_up, down = packed.layers[1].ffn.stacked()
    assert torch.equal(gate_up.dequantize(torch.float32)[5], torch.cat([experts[5].w1.weight, experts[5].w3.weight]))
    assert torch.equal(down.dequantize(torch.float32)[5], experts[5].w2.weight)
    prompt = make_prompt(30, seed=5)
    got, want = prefill(packed, packed.new_state(), prompt), prefill(loaded, loaded.new_state(), prompt)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # grouped projection: per-group matmuls


def test_rounding_in_place_is_the_packed_models_torch_twin(tiny_model):
    packed, rounded = copy.deepcopy(tiny_model(0)), copy.deepcopy(tiny_model(0))
    assert pack_model_(packed) == round_to_formats_(rounded)
    assert not any(isinstance(m, PackedLinear) for m in rounded.modules())
    assert pack_model_(packed)["expert_layers"] == 0  # already packed: nothing left to pack
    prompt = make_prompt(24, seed=8)
    torch.testing.assert_close(prefill(packed, packed.new_state(), prompt),
                               prefill(rounded, rounded.new_state(), prompt), rtol=1e-5, atol=1e-5)


def test_unknown_formats_are_refused(tiny_model):
    with pytest.raises(ValueError, match="experts must be one of"):
        pack_model_(copy.deepcopy(tiny_model(0)), experts="int4")
    with pytest.raises(ValueError, match="linears must be one of|experts must be one of"):
        pack_model_(copy.deepcopy(tiny_model(0)), linears="mxfp4")


def test_an_engine_serves_released_weights_with_its_own_identity(tiny_dir):
    from engine.engine_core import EngineConfig, EngineCore, EngineRequest
    from messages.common import SamplingParams

    with pytest.raises(ValueError, match="weights must be one of"):
        EngineConfig(model_dir=str(tiny_dir(0)), weights="int4")
    plain = EngineCore(EngineConfig(model_dir=str(tiny_dir(0)), dtype="float32", num_pages=16))
    packed = EngineCore(EngineConfig(model_dir=str(tiny_dir(0)), dtype="float32", num_pages=16, weights="released"))
    assert any(isinstance(m, PackedLinear) for m in packed.model.modules())
    assert packed.model_id != plain.model_id  # their KV blocks must never be shared
    prompt = make_prompt(20, seed=4).tolist()
    for engine in (plain, packed):
        engine.add_request(EngineRequest("r", prompt, SamplingParams(max_tokens=4, ignore_eos=True)))
    tokens = {}
    for name, engine in (("plain", plain), ("packed", packed)):
        out = []
        while engine.has_unfinished():
            out += [t for o in engine.step() for t in o.new_token_ids]
        tokens[name] = out
    assert len(tokens["packed"]) == 4 and len(tokens["plain"]) == 4
