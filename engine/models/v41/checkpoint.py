"""The released DeepSeek V4.1 checkpoint: tensor names, shapes, storage formats, and a dequantizing loader.

Names are the flat reference names (`embed.weight`, `layers.3.attn.wq_a.weight`,
`layers.3.ffn.experts.7.w2.weight`, ...). Storage, per the release:
- FP8 e4m3 with float8_e8m0fnu scales over 32x32 blocks: attn wq_a/wq_b/wkv/wo_a/wo_b,
  attn.indexer.wq_b, the shared expert and engram.wkv;
- MXFP4 (int8, two e2m1 per byte) with e8m0 scales per row and 32 columns: the routed experts;
- FP8 with e8m0 scales per row and 32 columns: the Engram tables (engram.embed);
- float32: head, hyper-connection mixers, attention sinks, compressor wkv/wgate, router biases;
- bfloat16: everything else (embeddings, norms, router weight, indexer keys, ...).
A quantized tensor `X.weight` has its scale in `X.scale`. DSpark (`mtp.*`) and vision
(`vision.*`, `aligner.*`, `image_*`) tensors ship too; the text model skips them.

Checkpoints as users have them load too, tensor by tensor (the reference's adapter decides the same
way): an unquantized tensor may be stored in float32 or bfloat16 (cast on load to what the release
keeps), and a quantized weight may come dequantized, float32 or bfloat16 at its full shape with no
scale (the common community BF16 export). Anything else (another dtype or shape, an FP8/MXFP4
weight without its scale, a scale for a weight the release does not quantize) is refused, naming
the tensor.

The vision tower (`vision_tensor_specs`) is never quantized: NeMo's adapter quantizes only
`layers.N.` attention/expert/Engram names, and its vision norms are kept fp32
(`_keep_in_fp32_modules_strict`: `vision.norm`, `norm1.weight`, `norm2.weight`); every other vision,
aligner and `image_*` tensor is bfloat16. `iter_vision_state_dict` reads only those.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from engine.quant.fp8_blocks import V41_BLOCK, dequantize_fp8, scale_shape
from engine.quant.mxfp4 import GROUP as MXFP4_GROUP
from engine.quant.mxfp4 import dequantize_mxfp4
from engine.models.v41.config import V41Config, load_v41_config

BF16, FP32, FP8, MXFP4, FP8_ROWS = "bf16", "fp32", "fp8", "mxfp4", "fp8_rows"
QUANTIZED = (FP8, MXFP4, FP8_ROWS)
FLOAT_STORAGE = (torch.float32, torch.bfloat16)  # how an unquantized (or dequantized) tensor may be stored
VISION_PREFIXES = ("vision.", "aligner.", "image_")
SKIPPED_PREFIXES = ("mtp.", *VISION_PREFIXES)
_LAYER = re.compile(r"^layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One released weight: its dequantized shape and how the file stores it."""

    shape: tuple[int, ...]
    format: str  # BF16 | FP32 | FP8 (32x32 blocks) | MXFP4 | FP8_ROWS (row x 32 columns)

    @property
    def quantized(self) -> bool:
        return self.format in QUANTIZED

    @property
    def dtype(self) -> torch.dtype:
        """The stored dtype of the weight itself."""
        return {BF16: torch.bfloat16, FP32: torch.float32, FP8: torch.float8_e4m3fn,
                FP8_ROWS: torch.float8_e4m3fn, MXFP4: torch.int8}[self.format]

    @property
    def stored_shape(self) -> tuple[int, ...]:
        if self.format == MXFP4:
            return self.shape[0], self.shape[1] // 2
        return self.shape

    @property
    def scale_shape(self) -> tuple[int, int] | None:
        rows, columns = self.shape if self.quantized else (0, 0)
        if self.format == FP8:
            return scale_shape(rows, columns, V41_BLOCK, V41_BLOCK)
        if self.format in (MXFP4, FP8_ROWS):
            return rows, columns // MXFP4_GROUP
        return None

    def stored(self, name: str) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(name, shape, dtype) of every tensor the file holds for this weight (the scale second)."""
        entries = [(name, self.stored_shape, self.dtype)]
        if self.quantized:
            entries.append((scale_name(name), self.scale_shape, torch.float8_e8m0fnu))
        return entries


def scale_name(weight_name: str) -> str:
    return weight_name.removesuffix(".weight") + ".scale"


def released_tensor_specs(config: V41Config) -> dict[str, TensorSpec]:
    """Every text-model weight of the release (no DSpark, no vision), in file order; scales via `stored`."""
    c = config
    if c.hidden_size % MXFP4_GROUP or c.moe_intermediate_size % MXFP4_GROUP:
        raise ValueError(f"MXFP4 experts need hidden and moe_intermediate sizes divisible by {MXFP4_GROUP}")
    if c.engram_layer_ids and c.engram_head_dim % MXFP4_GROUP:
        raise ValueError(f"FP8 Engram tables need engram_head_dim divisible by {MXFP4_GROUP}")
    specs = {"embed.weight": TensorSpec((c.vocab_size, c.hidden_size), BF16)}
    for layer in range(c.num_layers):
        specs.update(_layer_specs(c, layer))
    specs["norm.weight"] = TensorSpec((c.hidden_size,), BF16)
    specs["head.weight"] = TensorSpec((c.vocab_size, c.hidden_size), FP32)
    return specs


def vision_tensor_specs(config: V41Config) -> dict[str, TensorSpec]:
    """The vision tower's weights (ViT, aligner, learned span vectors); empty without one."""
    v, h = config.vision, config.hidden_size
    if not v.enabled:
        return {}
    d, patch_dim = v.hidden_size, 3 * v.patch_size ** 2
    specs = {"vision.patch_embed.proj.weight": TensorSpec((d, patch_dim), BF16),
             "vision.patch_embed.proj.bias": TensorSpec((d,), BF16)}
    for block in range(v.num_layers):
        p = f"vision.blocks.{block}."
        specs.update({
            p + "norm1.weight": TensorSpec((d,), FP32),
            p + "attn.wqkv.weight": TensorSpec((3 * d, d), BF16),
            p + "attn.wqkv.bias": TensorSpec((3 * d,), BF16),
            p + "attn.wo.weight": TensorSpec((d, d), BF16),
            p + "attn.wo.bias": TensorSpec((d,), BF16),
            p + "norm2.weight": TensorSpec((d,), FP32),
            p + "mlp.w1.weight": TensorSpec((2 * v.intermediate_size, d), BF16),
            p + "mlp.w2.weight": TensorSpec((d, v.intermediate_size), BF16),
        })
    specs["vision.norm.weight"] = TensorSpec((d,), FP32)
    specs.update({
        "aligner.w1.weight": TensorSpec((h, d * v.downsample_ratio ** 2), BF16),
        "aligner.w1.bias": TensorSpec((h,), BF16),
        "aligner.w2.weight": TensorSpec((h, h), BF16),
        "aligner.w2.bias": TensorSpec((h,), BF16),
    })
    for name in ("image_start", "image_newline", "image_end"):
        specs[name] = TensorSpec((h,), BF16)
    return specs


def _layer_specs(c: V41Config, layer: int) -> dict[str, TensorSpec]:
    h, heads_dim, mix = c.hidden_size, c.num_heads * c.head_dim, (2 + c.hc_mult) * c.hc_mult
    inter = c.moe_intermediate_size
    shared = inter * c.n_shared_experts
    p = f"layers.{layer}."
    specs = {
        p + "attn_norm.weight": TensorSpec((h,), BF16),
        p + "ffn_norm.weight": TensorSpec((h,), BF16),
    }
    for site in ("attn", "ffn"):
        specs[f"{p}hc_{site}_fn"] = TensorSpec((mix, c.hc_mult * h), FP32)
        specs[f"{p}hc_{site}_base"] = TensorSpec((mix,), FP32)
        specs[f"{p}hc_{site}_scale"] = TensorSpec((3,), FP32)
    a = p + "attn."
    specs.update({
        a + "wq_a.weight": TensorSpec((c.q_lora_rank, h), FP8),
        a + "q_norm.weight": TensorSpec((c.q_lora_rank,), BF16),
        a + "wq_b.weight": TensorSpec((heads_dim, c.q_lora_rank), FP8),
        a + "wkv.weight": TensorSpec((c.head_dim, h), FP8),
        a + "kv_norm.weight": TensorSpec((c.head_dim,), BF16),
        a + "wo_a.weight": TensorSpec((c.o_groups * c.o_lora_rank, heads_dim // c.o_groups), FP8),
        a + "wo_b.weight": TensorSpec((h, c.o_groups * c.o_lora_rank), FP8),
        a + "attn_sink": TensorSpec((c.num_heads,), FP32),
    })
    if layer in c.kv_source_layer_ids:  # owns the compressed KV (ratio 1 has no gate: no pooling)
        specs[a + "compressor.wkv.weight"] = TensorSpec((c.head_dim, h), FP32)
        if c.compress_ratios[layer] > 1:
            specs[a + "compressor.wgate.weight"] = TensorSpec((c.head_dim, h), FP32)
        specs[a + "compressor.norm.weight"] = TensorSpec((c.head_dim,), BF16)
    if layer in c.index_source_layer_ids:  # own queries; KV sources also own the indexer keys
        specs[a + "indexer.wq_b.weight"] = TensorSpec((c.index_n_heads * c.index_head_dim, c.q_lora_rank), FP8)
        specs[a + "indexer.weights_proj.weight"] = TensorSpec((c.index_n_heads, h), BF16)
        if layer in c.kv_source_layer_ids:
            specs[a + "indexer.wk.weight"] = TensorSpec((c.index_head_dim, c.head_dim), BF16)
            specs[a + "indexer.k_norm.weight"] = TensorSpec((c.index_head_dim,), BF16)
    f = p + "ffn."
    specs[f + "gate.weight"] = TensorSpec((c.n_routed_experts, h), BF16)
    specs[f + "gate.bias"] = TensorSpec((c.n_routed_experts,), FP32)
    specs[f + "gate.bias_vl"] = TensorSpec((c.n_routed_experts,), FP32)
    for expert in range(c.n_routed_experts):
        e = f"{f}experts.{expert}."
        specs[e + "w1.weight"] = TensorSpec((inter, h), MXFP4)
        specs[e + "w2.weight"] = TensorSpec((h, inter), MXFP4)
        specs[e + "w3.weight"] = TensorSpec((inter, h), MXFP4)
    specs[f + "shared_experts.w1.weight"] = TensorSpec((shared, h), FP8)
    specs[f + "shared_experts.w2.weight"] = TensorSpec((h, shared), FP8)
    specs[f + "shared_experts.w3.weight"] = TensorSpec((shared, h), FP8)
    if layer in c.engram_layer_ids:
        rows = c.engram_num_embeddings[c.engram_layer_ids.index(layer)]
        hash_heads = (c.engram_max_ngram_size - 1) * c.engram_n_heads
        g = p + "engram."
        specs[g + "embed.weight"] = TensorSpec((rows, c.engram_head_dim), FP8_ROWS)
        specs[g + "wkv.weight"] = TensorSpec(((c.hc_mult + 1) * h, hash_heads * c.engram_head_dim), FP8)
        specs[g + "q_weight"] = TensorSpec((c.hc_mult, h), BF16)
        specs[g + "k_weight"] = TensorSpec((c.hc_mult, h), BF16)
    return specs


def dequantize_weight(spec: TensorSpec, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dequantized [rows, cols] of a stored quantized weight."""
    if spec.format == MXFP4:
        return dequantize_mxfp4(weight, scale, dtype)
    block = (V41_BLOCK, V41_BLOCK) if spec.format == FP8 else (1, MXFP4_GROUP)
    return dequantize_fp8(weight, scale, *block, dtype)


def iter_v41_state_dict(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    keep_engram_fp8: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(released name, tensor) one at a time, quantized weights decoded on the CPU.

    Tensors the release keeps in float32 come out float32 (the reference keeps them so in any model
    dtype); every other one comes out in `dtype`. With `keep_engram_fp8` a quantized Engram table
    comes as stored (`...engram.embed.weight` FP8 and `...engram.embed.scale` e8m0, on the CPU
    whatever `device`): decoded it would double ~94 GiB per layer; a dequantized one comes alone,
    as stored. Layers past the config's num_hidden_layers are skipped (a truncated config over a
    full checkpoint), as are DSpark and vision tensors. A tensor the release does not have, a
    missing one, or one stored in a form the module docstring does not list is an error.
    """
    model_dir = Path(model_dir)
    config = load_v41_config(model_dir)
    specs = released_tensor_specs(config)
    location = _tensor_files(model_dir)
    scales = {scale_name(name) for name, spec in specs.items() if spec.quantized}
    unexpected = sorted(k for k in location if k not in specs and k not in scales and not _skipped(k, config))
    if unexpected:
        raise KeyError(f"{len(unexpected)} tensors the V4.1 release does not have: {unexpected[:5]}")
    missing = sorted(set(specs) - set(location))
    if missing:
        raise KeyError(f"{len(missing)} tensors missing from {model_dir}: {missing[:5]}")
    with _Shards(model_dir, location) as shards:
        for name, spec in specs.items():
            weight, scale = _read_stored(shards, name, spec)
            if scale is None:  # unquantized, or a dequantized export of a quantized weight
                if keep_engram_fp8 and spec.format == FP8_ROWS:
                    yield name, weight
                    continue
                yield name, weight.to(device=device, dtype=torch.float32 if spec.format == FP32 else dtype)
            elif keep_engram_fp8 and spec.format == FP8_ROWS:
                yield name, weight
                yield scale_name(name), scale
            else:
                yield name, dequantize_weight(spec, weight, scale, dtype).to(device)


def _read_stored(shards: "_Shards", name: str, spec: TensorSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, its scale) as the release stores it, or (a float32/bfloat16 weight at its full shape, None)."""
    weight, scale_key = shards.get(name), scale_name(name)
    if spec.quantized and scale_key in shards.location:
        _check(shards, name, weight, spec.stored_shape, spec.dtype)
        scale = shards.get(scale_key)
        if scale.dtype == torch.uint8:
            scale = scale.view(torch.float8_e8m0fnu)  # some exports store e8m0 bytes as U8
        _check(shards, scale_key, scale, spec.scale_shape, torch.float8_e8m0fnu)
        return weight, scale
    if spec.quantized and weight.dtype == spec.dtype:
        raise KeyError(f"{name} in {shards.location[name].name} is quantized ({weight.dtype}) "
                       f"but its scale {scale_key} is missing")
    if weight.dtype not in FLOAT_STORAGE or tuple(weight.shape) != spec.shape:
        release = f"{spec.dtype} {spec.stored_shape}" + (f" with {scale_key}" if spec.quantized else "")
        raise ValueError(f"{name} in {shards.location[name].name}: {weight.dtype} {tuple(weight.shape)}; "
                         f"loadable forms are {release}, or float32/bfloat16 {spec.shape}")
    return weight, None


def _check(shards: "_Shards", key: str, tensor: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
    if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
        raise ValueError(f"{key} in {shards.location[key].name}: {tensor.dtype} {tuple(tensor.shape)}, "
                         f"the release stores {dtype} {tuple(shape)}")


def load_v41_state_dict(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    keep_engram_fp8: bool = False,
) -> dict[str, torch.Tensor]:
    """The whole dequantized text model under its released names (see `iter_v41_state_dict`)."""
    return dict(iter_v41_state_dict(model_dir, device, dtype, keep_engram_fp8))


def iter_vision_state_dict(
    model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(released name, tensor) of the vision tower only: tensors the release keeps in float32 come out
    float32, the rest in `dtype` (either may be stored in float32 or bfloat16). A model without a
    vision encoder, a missing tensor or a wrong shape or dtype is an error, as is a vision tensor the
    config does not describe; text and DSpark tensors are not read."""
    model_dir = Path(model_dir)
    config = load_v41_config(model_dir)
    if not config.vision.enabled:
        raise ValueError(f"{model_dir}: the config has no vision encoder (vision_config.num_hidden_layers is 0)")
    specs = vision_tensor_specs(config)
    location = _tensor_files(model_dir)
    missing = sorted(name for name in specs if name not in location)
    if missing:
        raise KeyError(f"{len(missing)} vision tensors missing from {model_dir}: {missing[:5]}")
    unexpected = sorted(k for k in location if k.startswith(VISION_PREFIXES) and k not in specs)
    if unexpected:
        raise KeyError(f"{len(unexpected)} vision tensors the config does not describe: {unexpected[:5]}")
    with _Shards(model_dir, location) as shards:
        for name, spec in specs.items():
            tensor, _ = _read_stored(shards, name, spec)
            yield name, tensor.to(device=device, dtype=torch.float32 if spec.format == FP32 else dtype)


def _skipped(key: str, config: V41Config) -> bool:
    if key.startswith(SKIPPED_PREFIXES):
        return True
    layer = _LAYER.match(key)
    return layer is not None and int(layer.group(1)) >= config.num_layers


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the shard holding it (from the index when there is one)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    location = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt", device="cpu") as f:
            location.update((key, shard) for key in f.keys())
    return location


class _Shards:
    """Open shard handles, each opened once, closed on exit."""

    def __init__(self, model_dir: Path, location: dict[str, Path]):
        self.model_dir, self.location, self.handles = model_dir, location, {}

    def __enter__(self) -> "_Shards":
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles.values():
            handle.__exit__(None, None, None)
        self.handles.clear()

    def get(self, key: str) -> torch.Tensor:
        path = self.location[key]
        if path not in self.handles:
            self.handles[path] = safe_open(str(path), framework="pt", device="cpu").__enter__()
        return self.handles[path].get_tensor(key)
