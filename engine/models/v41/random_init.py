"""Seeded random-weight DeepSeek V4.1 model directories in exactly the released format.

config.json is the released nested layout (model_type deepseek_v41, text_config, vision_config,
image_token_id, quantization_config); the safetensors shards use the released names, and store
FP8 / MXFP4 with e8m0 scales wherever the release is quantized (see `engine.models.v41.checkpoint`).
The text model, and the vision tower when vision_config has layers (ViT, aligner and the learned
image_start/newline/end, bf16 with fp32 norms as released); no DSpark layers (num_nextn_predict_layers 0).

`write_v41_model_dir_from_tensors` writes given weights instead (a reference model's, say).

Random values are drawn chunk by chunk (a fixed number of rows per chunk, each chunk from its own
generator seeded by (seed, name, chunk)), then quantized and streamed into the shard file, so the
weights do not depend on write order or sharding, and a table larger than memory can be written;
adding the vision tower leaves every text weight as it was.
Parameters a fresh reference model leaves at zero (sinks, router biases) are randomised: zeros hide bugs.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path
from typing import Mapping

import torch

from engine.quant.fp8_blocks import ROW_GROUP, V41_BLOCK, quantize_fp8, quantize_fp8_blocks
from engine.quant.mxfp4 import quantize_mxfp4
from engine.models.v41.checkpoint import (
    FP8,
    FP8_ROWS,
    FP32,
    MXFP4,
    TensorSpec,
    released_tensor_specs,
    scale_name,
    vision_tensor_specs,
)
from engine.models.common.config_file import read_config_dict
from engine.models.v41.config import V41Config, load_v41_config
from engine.models.v41.safetensors_stream import SafetensorsStream
from engine.models.v41.tokenizer_file import V41_VOCAB_SIZE, write_v41_tokenizer

MAX_SHARD_BYTES = 4 << 30
CHUNK_ELEMENTS = 1 << 22  # values drawn per generator; a chunk is whole 32-row blocks
# What the release's quantization_config says: FP8 linears in 32x32 ue8m0 blocks, MXFP4 experts.
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
                       "weight_block_size": [V41_BLOCK, V41_BLOCK], "expert_dtype": "fp4"}


def write_random_v41_model_dir(
    config_name_or_path: str | Path | dict = "tiny-v41",
    out_dir: str | Path = "models/tiny-v41",
    seed: int = 0,
    vocab_size: int | None = None,
) -> Path:
    """Write config.json, model*.safetensors (sharded past 4 GiB, with an index) and tokenizer.json.

    The vocabulary defaults to the real 129,280 tokens whatever the source config says.
    """
    raw = read_raw_config(config_name_or_path)
    text = dict(raw.get("text_config") or raw)
    text["vocab_size"] = int(vocab_size or V41_VOCAB_SIZE)
    raw = {**raw, "text_config": text}
    return _write_model_dir(raw, out_dir, lambda name, spec, begin, end: random_rows(name, spec, begin, end, seed))


def write_v41_model_dir_from_tensors(
    config_name_or_path: str | Path | dict, out_dir: str | Path, tensors: Mapping[str, torch.Tensor]
) -> Path:
    """A model directory holding the given weights (released names, full precision) in the released
    format; quantized ones are rounded as the release rounds (power-of-two scales rounded up)."""
    raw = read_raw_config(config_name_or_path)

    def rows(name: str, spec: TensorSpec, begin: int, end: int) -> torch.Tensor:
        value = tensors[name]
        if tuple(value.shape) != spec.shape:
            raise ValueError(f"{name}: shape {tuple(value.shape)}, the release has {spec.shape}")
        return (value[begin:end] if value.ndim == 2 else value).float()

    return _write_model_dir(raw, out_dir, rows)


def _write_model_dir(raw: dict, out_dir: str | Path, values) -> Path:
    config = load_v41_config(raw)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(released_config(raw, config), indent=2) + "\n")
    _write_weights(out, {**released_tensor_specs(config), **vision_tensor_specs(config)}, values)
    write_v41_tokenizer(out)
    return out


def read_raw_config(name_or_path: str | Path | dict) -> dict:
    """The config dict of a bundled name (`tiny-v41`), a JSON file, a model directory, or a dict."""
    if isinstance(name_or_path, dict):
        return json.loads(json.dumps(name_or_path))
    return read_config_dict(name_or_path)


def released_config(raw: dict, config: V41Config) -> dict:
    """The nested config.json, every field the weights depend on made explicit."""
    text = {k: v for k, v in (raw.get("text_config") or raw).items()
            if k not in ("text_config", "vision_config", "quantization_config", "torch_dtype")}
    c = config
    eos = list(c.eos_token_ids) if len(c.eos_token_ids) > 1 else c.eos_token_id  # a list, as HF writes several
    text.update(
        model_type="deepseek_v41_text", vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=1,
        head_dim=c.head_dim, qk_rope_head_dim=c.rope_dim, q_lora_rank=c.q_lora_rank, o_groups=c.o_groups,
        o_lora_rank=c.o_lora_rank, moe_intermediate_size=c.moe_intermediate_size,
        n_routed_experts=c.n_routed_experts, num_experts_per_tok=c.experts_per_token,
        n_shared_experts=c.n_shared_experts, scoring_func=c.scoring_func, topk_method="noaux_tc",
        norm_topk_prob=c.norm_topk_prob, routed_scaling_factor=c.routed_scaling_factor, swiglu_limit=c.swiglu_limit,
        hidden_act="silu", rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        compress_rope_theta=c.compress_rope_theta, rope_scaling=dict(c.rope_scaling),
        max_position_embeddings=c.max_position_embeddings, sliding_window=c.sliding_window,
        compress_ratios=list(c.compress_ratios), kv_source_layer_ids=list(c.kv_source_layer_ids),
        index_source_layer_ids=list(c.index_source_layer_ids), index_n_heads=c.index_n_heads,
        index_head_dim=c.index_head_dim, index_topk=c.index_topk,
        candidate_source_layer_id=c.candidate_source_layer_id, candidate_topk_blocks=c.candidate_topk_blocks,
        candidate_block_size=c.candidate_block_size, hc_mult=c.hc_mult, hc_sinkhorn_iters=c.hc_sinkhorn_iters,
        hc_eps=c.hc_eps, engram_layer_ids=list(c.engram_layer_ids),
        engram_num_embeddings=list(c.engram_num_embeddings), engram_max_ngram_size=c.engram_max_ngram_size,
        engram_vocab_size=c.engram_vocab_size, engram_n_heads=c.engram_n_heads,
        engram_head_dim=c.engram_head_dim, engram_pad_token_id=c.engram_pad_token_id,
        engram_compressed_vocab_size=c.engram_compressed_vocab_size, num_nextn_predict_layers=0,
        tie_word_embeddings=False, dtype="bfloat16",
        bos_token_id=c.bos_token_id, eos_token_id=eos, pad_token_id=c.pad_token_id,
    )
    vision = {**(raw.get("vision_config") or {}), **c.vision.to_dict()}
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "text_config": text,
        "vision_config": vision,
        "image_token_id": c.image_token_id,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": eos,
        "pad_token_id": c.pad_token_id,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "quantization_config": dict(QUANTIZATION_CONFIG),
    }


def chunk_rows(spec: TensorSpec) -> int:
    """Rows drawn per generator: whole 32-row blocks, about CHUNK_ELEMENTS values (shape-determined)."""
    columns = spec.shape[1] if len(spec.shape) == 2 else max(1, math.prod(spec.shape))
    return max(V41_BLOCK, CHUNK_ELEMENTS // columns // V41_BLOCK * V41_BLOCK)


def random_rows(name: str, spec: TensorSpec, begin: int, end: int, seed: int) -> torch.Tensor:
    """float32 values of rows [begin, end) of one weight (the whole tensor if it is 1-D)."""
    chunk = begin // chunk_rows(spec)
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(f"{name}#{chunk}".encode()))
    shape = (end - begin, *spec.shape[1:]) if len(spec.shape) == 2 else spec.shape
    leaf = name.removesuffix(".weight").rsplit(".", 1)[-1]
    fan_in = spec.shape[-1]
    if leaf in ("attn_sink",) or leaf.endswith("_base"):
        return 0.5 * torch.randn(shape, generator=g)
    if leaf.endswith("_scale"):
        return 0.5 + torch.rand(shape, generator=g)
    if leaf in ("bias", "bias_vl"):
        return 0.1 * torch.randn(shape, generator=g)
    if "norm" in leaf or leaf in ("q_weight", "k_weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if name in ("embed.weight", "image_start", "image_newline", "image_end") or name.endswith("engram.embed.weight"):
        return torch.randn(shape, generator=g)
    if ".experts." in name or ".shared_experts." in name:
        gain = 0.25 if leaf == "w2" else 4.0  # w1/w3 reach swiglu_limit
        return gain / math.sqrt(fan_in) * torch.randn(shape, generator=g)
    return torch.randn(shape, generator=g) / math.sqrt(fan_in)  # projections, hc fn, router, head


def stored_chunk(spec: TensorSpec, values: torch.Tensor) -> list[torch.Tensor]:
    """The stored tensor(s) of a chunk of rows: [weight] or [weight, scale]."""
    if spec.format == FP8:
        return list(quantize_fp8_blocks(values, V41_BLOCK))
    if spec.format == FP8_ROWS:
        return list(quantize_fp8(values, 1, ROW_GROUP))
    if spec.format == MXFP4:
        return list(quantize_mxfp4(values))
    return [values.to(torch.float32 if spec.format == FP32 else torch.bfloat16)]


def plan_shards(specs: dict[str, TensorSpec], max_bytes: int) -> list[list[str]]:
    """Weights grouped into shards of at most max_bytes (a weight and its scale stay together)."""
    shards, current, size = [], [], 0
    for name, spec in specs.items():
        nbytes = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in spec.stored(name))
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    shards.append(current)
    return shards


def _write_weights(out: Path, specs: dict[str, TensorSpec], values) -> None:
    """`values(name, spec, begin, end)` gives float32 rows [begin, end) of a weight (all of a 1-D one)."""
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    shards = plan_shards(specs, MAX_SHARD_BYTES)
    weight_map, total = {}, 0
    for i, names in enumerate(shards):
        file = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        entries = [entry for name in names for entry in specs[name].stored(name)]
        with SafetensorsStream(out / file, entries) as stream:
            for name in names:
                _write_tensor(stream, name, specs[name], values)
            total += stream.total_bytes
        weight_map.update((entry[0], file) for entry in entries)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_tensor(stream: SafetensorsStream, name: str, spec: TensorSpec, values) -> None:
    rows = spec.shape[0] if len(spec.shape) == 2 else 1
    step = chunk_rows(spec) if len(spec.shape) == 2 else 1
    offsets = {}
    for begin in range(0, rows, step):
        pieces = stored_chunk(spec, values(name, spec, begin, min(rows, begin + step)))
        for key, piece in zip((name, scale_name(name)), pieces):
            stream.write(key, offsets.get(key, 0), piece)
            offsets[key] = offsets.get(key, 0) + piece.numel() * piece.element_size()
