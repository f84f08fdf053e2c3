"""Seeded random-weight model directories and the `epd model init` command."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file

from engine.models.v4 import load_model
from engine.models.v4 import random_init
from engine.models.v4.random_init import tokenizer_json_path, write_random_model_dir
from ops.model_commands import register


def weights(model_dir) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def test_same_seed_same_weights_other_seed_other_weights(tmp_path, tiny_dir):
    again = write_random_model_dir("tiny", tmp_path / "again", seed=0, vocab_size=1024, dtype=torch.float32)
    other = write_random_model_dir("tiny", tmp_path / "other", seed=5, vocab_size=1024, dtype=torch.float32)
    first, second, third = weights(tiny_dir(0)), weights(again), weights(other)
    assert first.keys() == second.keys() == third.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    name = "model.layers.1.self_attn.q_a_proj.weight"
    assert not torch.equal(first[name], third[name])


def test_parameters_a_fresh_reference_leaves_at_zero_are_randomised(tiny_dir):
    tensors = weights(tiny_dir(0))
    tid2eid = tensors["model.layers.0.mlp.gate.tid2eid"]
    assert tid2eid.dtype == torch.int64 and tid2eid.shape == (1024, 2)
    assert (tid2eid[:, 0] != tid2eid[:, 1]).all() and len(tid2eid.unique()) == 8
    for name in (
        "model.layers.1.self_attn.sinks",
        "model.layers.1.self_attn.compressor.position_bias",
        "model.layers.1.self_attn.compressor.indexer.position_bias",
        "model.layers.2.self_attn.compressor.position_bias",
        "model.layers.2.mlp.gate.e_score_correction_bias",
        "model.layers.0.attn_hc.base",
    ):
        assert tensors[name].abs().min() > 0, name


def test_directory_has_reference_config_and_v4_tokenizer(tiny_dir):
    transformers = pytest.importorskip("transformers")
    model_dir = tiny_dir(0)
    raw = json.loads((model_dir / "config.json").read_text())
    assert raw["model_type"] == "deepseek_v4" and raw["vocab_size"] == 1024
    config = transformers.DeepseekV4Config(**raw)
    assert config.layer_types == raw["layer_types"] and config.mlp_layer_types == raw["mlp_layer_types"]
    assert (model_dir / "tokenizer.json").read_bytes() == tokenizer_json_path().read_bytes()


def test_large_models_are_sharded_with_an_index(tmp_path, tiny_dir, monkeypatch):
    monkeypatch.setattr(random_init, "MAX_SHARD_BYTES", 4 << 20)
    out = write_random_model_dir("tiny", tmp_path / "sharded", seed=0, vocab_size=1024, dtype=torch.float32)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (out / "model.safetensors").exists()
    sharded, single = load_model(out, dtype=torch.float32), load_model(tiny_dir(0), dtype=torch.float32)
    single_weights = single.state_dict()
    assert all(torch.equal(t, single_weights[name]) for name, t in sharded.state_dict().items())


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="epd")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_model_init_command_writes_a_loadable_directory(tmp_path):
    out = tmp_path / "cli"
    assert run_cli(["model", "init", "--config", "tiny", "--out", str(out), "--seed", "3", "--vocab-size", "1024"]) == 0
    model = load_model(out)
    assert model.config.vocab_size == 1024 and model.dtype == torch.bfloat16
    assert model([torch.tensor([0, 5, 9])], [model.new_state()]).shape == (1, 1024)


def test_model_init_defaults_to_the_real_vocabulary(tmp_path):
    out = tmp_path / "full_vocab"
    assert run_cli(["model", "init", "--out", str(out)]) == 0
    raw = json.loads((out / "config.json").read_text())
    assert raw["vocab_size"] == 129280 and raw["hidden_size"] == 256
    with open(out / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header["lm_head.weight"]["shape"] == [129280, 256]
    assert header["model.layers.0.mlp.gate.tid2eid"]["shape"] == [129280, 2]
