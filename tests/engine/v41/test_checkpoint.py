"""The released V4.1 checkpoint format: tensor specs, the random-model writer, the dequantizing loader,
and agreement with the reference (NeMo's state-dict adapter) on names, formats and values."""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine.quant import dequantize_fp8_blocks, dequantize_mxfp4, quantize_fp8, quantize_fp8_blocks, quantize_mxfp4
from engine.models.v41 import random_init
from engine.models.v41.checkpoint import (
    FP8,
    FP8_ROWS,
    FP32,
    MXFP4,
    iter_v41_state_dict,
    iter_vision_state_dict,
    load_v41_state_dict,
    released_tensor_specs,
    vision_tensor_specs,
)
from engine.models.v41.config import V41Config, load_v41_config
from engine.models.v41.random_init import random_rows, write_random_v41_model_dir, write_v41_model_dir_from_tensors
from engine.models.v41.tokenizer_file import write_v41_tokenizer
from ops.model_commands import register
from tests.helpers import test_helper_nemo_v41 as nemo_helper

VOCAB = 1024
CONFIG = "tiny-v41"
needs_nemo = pytest.mark.skipif(not nemo_helper.nemo_available(), reason=nemo_helper.NEMO_MISSING)


@pytest.fixture(scope="module")
def config():
    raw = random_init.read_raw_config(CONFIG)
    raw["text_config"]["vocab_size"] = VOCAB
    return load_v41_config(raw)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_v41_model_dir(CONFIG, tmp_path_factory.mktemp("v41") / "m", seed=0, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load_v41_state_dict(model_dir, dtype=torch.float32)


def stored_layout(model_dir) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    layout = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                tensor = f.get_tensor(key)
                layout[key] = (tuple(tensor.shape), tensor.dtype)
    return layout


def expected_layout(config) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    specs = {**released_tensor_specs(config), **vision_tensor_specs(config)}
    return {key: (shape, dtype) for name, spec in specs.items() for key, shape, dtype in spec.stored(name)}


# ---- the specs


def test_specs_cover_every_layer_role(config):
    specs = released_tensor_specs(config)
    assert specs["head.weight"].format == FP32 and specs["embed.weight"].dtype == torch.bfloat16
    for layer in range(config.num_layers):
        role, p = config.role(layer), f"layers.{layer}.attn."
        assert (p + "compressor.wkv.weight" in specs) == (role == "source")
        assert (p + "compressor.wgate.weight" in specs) == (role == "source" and config.compress_ratios[layer] > 1)
        assert (p + "indexer.wq_b.weight" in specs) == (role in ("source", "reindex"))
        assert (p + "indexer.wk.weight" in specs) == (role == "source")
        assert (f"layers.{layer}.engram.embed.weight" in specs) == (layer in config.engram_layer_ids)
    assert specs["layers.0.ffn.experts.7.w2.weight"].format == MXFP4
    assert specs["layers.0.ffn.experts.7.w2.weight"].stored_shape == (256, 64)
    assert specs["layers.0.ffn.shared_experts.w1.weight"].format == FP8
    engram = specs[f"layers.{config.engram_layer_ids[0]}.engram.embed.weight"]
    assert engram.format == FP8_ROWS and engram.scale_shape == (config.engram_num_embeddings[0], 2)


@needs_nemo
def test_specs_are_the_reference_on_disk_layout(config):
    """NeMo's adapter lists the release's stored tensors (`to_hf(quantization=True)`): same names,
    shapes and dtypes, scales included."""
    nemo = reference_model_on_meta(config)
    theirs = nemo.state_dict_adapter.to_hf(nemo.state_dict(), quantization=True, for_checkpoint_load=True)
    assert {k: (tuple(v.shape), v.dtype) for k, v in theirs.items()} == expected_layout(config)


def test_model_parameters_are_the_released_names(config):
    """The engine's V4.1 model names its parameters as the release does; Engram tables live outside
    the state dict (host memory, loaded with `load_table`)."""
    from engine.models.v41.model import DeepseekV41

    with torch.device("meta"):
        model = DeepseekV41(config)
    specs = {name: spec for name, spec in released_tensor_specs(config).items()
             if not name.endswith("engram.embed.weight")}
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == {k: s.shape for k, s in specs.items()}


# ---- the writer


def test_directory_is_the_released_layout(model_dir, config):
    raw = json.loads((model_dir / "config.json").read_text())
    assert raw["model_type"] == "deepseek_v41" and raw["architectures"] == ["DeepseekV41ForCausalLM"]
    assert raw["image_token_id"] == 129264 and raw["vision_config"]["num_hidden_layers"] == 2
    assert raw["quantization_config"]["weight_block_size"] == [32, 32]
    assert raw["text_config"]["model_type"] == "deepseek_v41_text" and raw["text_config"]["vocab_size"] == VOCAB
    assert load_v41_config(model_dir) == config
    assert stored_layout(model_dir) == expected_layout(config)
    reference = write_v41_tokenizer(model_dir.parent / "tokenizer_only")
    assert (model_dir / "tokenizer.json").read_bytes() == reference.read_bytes()


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path, model_dir):
    again = write_random_v41_model_dir(CONFIG, tmp_path / "again", seed=0, vocab_size=VOCAB)
    other = write_random_v41_model_dir(CONFIG, tmp_path / "other", seed=3, vocab_size=VOCAB)
    digest = {d: hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest() for d in (model_dir, again, other)}
    assert digest[model_dir] == digest[again] != digest[other]


def test_values_are_the_seeded_draws_rounded_to_the_release_grid(loaded, config):
    specs = released_tensor_specs(config)
    for name in ("embed.weight", "layers.1.hc_attn_fn", "layers.2.attn.attn_sink", "layers.0.ffn.gate.bias_vl"):
        spec = specs[name]
        drawn = random_rows(name, spec, 0, spec.shape[0], 0)
        assert torch.equal(loaded[name], drawn if spec.format == FP32 else drawn.bfloat16().float()), name
    name = "layers.3.attn.wq_b.weight"
    drawn = random_rows(name, specs[name], 0, specs[name].shape[0], 0)
    assert torch.equal(loaded[name], dequantize_fp8_blocks(*quantize_fp8_blocks(drawn), dtype=torch.float32))
    name = "layers.4.ffn.experts.5.w1.weight"
    drawn = random_rows(name, specs[name], 0, specs[name].shape[0], 0)
    assert torch.equal(loaded[name], dequantize_mxfp4(*quantize_mxfp4(drawn), torch.float32))
    for name in ("layers.2.attn.attn_sink", "layers.0.ffn.gate.bias", "layers.0.ffn.gate.bias_vl",
                 "layers.0.hc_ffn_base"):
        assert loaded[name].abs().min() > 0, name  # a fresh reference leaves these at 0: zeros hide bugs
    assert loaded["layers.1.engram.q_weight"].std() > 0.05 and loaded["norm.weight"].std() > 0.05  # not all ones


def test_sharded_and_chunked_writes_hold_the_same_format(tmp_path, monkeypatch, config):
    """Shards split past MAX_SHARD_BYTES (a weight and its scale together, with an index); tensors are
    drawn and quantized in row chunks, and chunk-wise quantization equals quantizing the whole."""
    monkeypatch.setattr(random_init, "MAX_SHARD_BYTES", 1 << 20)
    monkeypatch.setattr(random_init, "CHUNK_ELEMENTS", 4096)
    out = write_random_v41_model_dir(CONFIG, tmp_path / "sharded", seed=0, vocab_size=VOCAB)
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 3 and not (out / "model.safetensors").exists()
    assert stored_layout(out) == expected_layout(config) and set(weight_map) == set(expected_layout(config))
    for name, file in weight_map.items():
        if name.endswith(".scale"):
            assert weight_map[name.removesuffix(".scale") + ".weight"] == file
    specs, stored = released_tensor_specs(config), {}
    for shard in set(weight_map.values()):
        stored.update(load_file(str(out / shard)))
    layer = config.engram_layer_ids[0]
    for name, quantize in (("embed.weight", None), ("layers.0.attn.wq_b.weight", quantize_fp8_blocks),
                           ("layers.1.ffn.experts.2.w2.weight", quantize_mxfp4),
                           (f"layers.{layer}.engram.embed.weight", lambda w: quantize_fp8(w, 1, 32))):
        spec, step = specs[name], random_init.chunk_rows(specs[name])
        assert step < spec.shape[0], name  # several chunks
        whole = torch.cat([random_rows(name, spec, b, min(b + step, spec.shape[0]), 0)
                           for b in range(0, spec.shape[0], step)])
        if quantize is None:
            assert torch.equal(stored[name], whole.bfloat16())
            continue
        weight, scale = quantize(whole)
        assert torch.equal(stored[name].view(torch.uint8), weight.view(torch.uint8)), name
        assert torch.equal(stored[name.removesuffix("weight") + "scale"].view(torch.uint8), scale.view(torch.uint8))
    assert load_v41_state_dict(out)["norm.weight"].dtype == torch.bfloat16


# ---- the loader


def test_loader_dtypes_and_engram_tables_kept_quantized(model_dir, config):
    specs = released_tensor_specs(config)
    bf16 = dict(iter_v41_state_dict(model_dir))
    assert set(bf16) == set(specs)
    for name, tensor in bf16.items():
        assert tensor.dtype == (torch.float32 if specs[name].format == FP32 else torch.bfloat16), name
        assert tuple(tensor.shape) == specs[name].shape
    raw = load_v41_state_dict(model_dir, keep_engram_fp8=True)
    table = f"layers.{config.engram_layer_ids[0]}.engram.embed"
    assert raw[table + ".weight"].dtype == torch.float8_e4m3fn and raw[table + ".scale"].dtype == torch.float8_e8m0fnu
    assert set(raw) == set(specs) | {f"layers.{i}.engram.embed.scale" for i in config.engram_layer_ids}


def copy_without_weights(model_dir, out):
    out.mkdir()
    for item in model_dir.iterdir():
        shutil.copyfile(item, out / item.name)
    return out


def test_loader_skips_dspark_vision_and_layers_past_the_config(tmp_path, model_dir, loaded):
    out = copy_without_weights(model_dir, tmp_path / "extra")
    save_file({"mtp.0.attn.wq_a.weight": torch.zeros(2, 2), "vision.patch_embed.weight": torch.zeros(2),
               "aligner.0.weight": torch.zeros(2), "image_newline": torch.zeros(2)},
              str(out / "model-extra.safetensors"))
    raw = json.loads((out / "config.json").read_text())
    raw["text_config"]["num_hidden_layers"] = 6  # a truncated config over the whole checkpoint
    (out / "config.json").write_text(json.dumps(raw))
    truncated = load_v41_state_dict(out, dtype=torch.float32)
    assert set(truncated) == {k for k in loaded if not k.startswith(("layers.6.", "layers.7."))}
    assert all(torch.equal(truncated[k], loaded[k]) for k in truncated)


@pytest.mark.parametrize("damage", ["unknown", "missing", "dtype"])
def test_loader_rejects_what_the_release_does_not_hold(tmp_path, model_dir, damage):
    out = copy_without_weights(model_dir, tmp_path / damage)
    tensors = load_file(str(out / "model.safetensors"))
    if damage == "unknown":
        tensors["layers.0.ffn.gate.tid2eid"] = torch.zeros(4, 2, dtype=torch.int64)  # V4's hash routing
    elif damage == "missing":
        del tensors["layers.2.attn.wq_a.scale"]
    else:
        tensors["layers.2.attn.wq_a.weight"] = tensors["layers.2.attn.wq_a.weight"].float()
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(KeyError if damage != "dtype" else ValueError):
        load_v41_state_dict(out)


# ---- agreement with the reference adapter


def reference_model_on_meta(config_or_dir):
    """NeMo's V4.1 model (bf16, on meta) for a written directory's config.json or a V41Config."""
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    if isinstance(config_or_dir, V41Config):
        raw = random_init.released_config({}, config_or_dir)
    else:
        raw = json.loads((config_or_dir / "config.json").read_text())
    vocab = raw["text_config"]["vocab_size"]
    # Engram hashing needs a tokenizer whose normalised vocabulary has the declared size: a word
    # level one of distinct words (hashing is not exercised here)
    raw["text_config"]["engram_compressed_vocab_size"] = vocab
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0")))
    with torch.device("meta"):
        return DeepseekV41ForCausalLM(DeepseekV41Config(**raw), backend=nemo_helper._backend("eager"),
                                      tokenizer=tokenizer)


@needs_nemo
def test_reference_adapter_loads_our_files_and_decodes_them_as_we_do(model_dir):
    nemo = reference_model_on_meta(model_dir)
    adapter = nemo.state_dict_adapter
    native = adapter.from_hf(load_file(str(model_dir / "model.safetensors")))
    nemo.load_state_dict(native, strict=True, assign=True)
    theirs = adapter.to_hf(nemo.state_dict())
    ours = {**load_v41_state_dict(model_dir, dtype=torch.bfloat16),
            **dict(iter_vision_state_dict(model_dir, dtype=torch.bfloat16))}
    assert set(theirs) == set(ours)
    for name, tensor in ours.items():
        assert tensor.dtype == theirs[name].dtype and torch.equal(tensor, theirs[name]), name


@needs_nemo
def test_reference_weights_written_in_the_released_format_load_back_exactly(tmp_path, config):
    """A NeMo model's weights (on the released grid) -> released files -> our loader: no value moves."""
    raw = random_init.released_config({}, config)
    nemo = nemo_helper.build_nemo_model(raw, seed=1)
    weights = nemo_helper.nemo_released_state_dict(nemo, vision=True)
    out = write_v41_model_dir_from_tensors(raw, tmp_path / "from_nemo", weights)
    ours = {**load_v41_state_dict(out, dtype=torch.float32), **dict(iter_vision_state_dict(out, dtype=torch.float32))}
    assert set(ours) == set(weights)
    for name, tensor in ours.items():
        assert torch.equal(tensor, weights[name]), name


# ---- `epd model init --arch`


def run_init(argv):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["model", "init", *argv])
    assert args.func(args) == 0


def test_model_init_writes_either_architecture(tmp_path, model_dir):
    run_init(["--arch", "v4.1", "--out", str(tmp_path / "v41"), "--vocab-size", str(VOCAB)])
    assert stored_layout(tmp_path / "v41") == stored_layout(model_dir)
    run_init(["--out", str(tmp_path / "v4"), "--vocab-size", str(VOCAB), "--dtype", "float32"])
    assert json.loads((tmp_path / "v4" / "config.json").read_text())["model_type"] == "deepseek_v4"
    with pytest.raises(SystemExit):
        run_init(["--arch", "v4.1", "--out", str(tmp_path / "bad"), "--dtype", "float32"])


# ---- the released-format round trip, as far as logits


@needs_nemo
def test_a_model_init_directory_gives_the_same_logits_through_nemo_and_through_our_engine(model_dir):
    """`epd model init --arch v4.1` output -> NeMo's state-dict adapter -> NeMo's forward, against
    our loader -> our forward: fp32, Engram on (both hash with the directory's tokenizer)."""
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

    from engine.loading import load_model

    raw = json.loads((model_dir / "config.json").read_text())
    with nemo_helper._memoised_token_map():   # built on the CPU: some of its buffers are made at init
        nemo = DeepseekV41ForCausalLM(DeepseekV41Config(**raw), backend=nemo_helper._backend("eager"),
                                      tokenizer=nemo_helper.engram_tokenizer(model_dir / "tokenizer.json"))
    nemo.load_state_dict(nemo.state_dict_adapter.from_hf(load_file(str(model_dir / "model.safetensors"))),
                         strict=True, assign=True)
    nemo = nemo.float().eval()
    ours = load_model(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(5)
    # screened (docs/design/v41-reference.md): longer prompts of this window-128 config flip a cache rounding more often
    candidates = [torch.randint(3, VOCAB, (length,), generator=generator).tolist() for length in range(20, 100, 8)]
    with torch.no_grad():
        screened = next(s for s in (nemo_helper.screen_prompt(nemo, ids) for ids in candidates) if s.kept)
        logits = ours([torch.tensor(screened.ids)], [ours.new_state()], all_logits=True)
    error = float((logits - screened.logits).abs().max() / screened.logits.abs().max())
    assert error <= 1e-4, error
