"""Load a model directory in Hugging Face layout (config.json + *.safetensors, either naming)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine.models.common.dtypes import parse_dtype
from engine.models.v4.checkpoint_names import ExpertPiece, translate
from engine.models.v4.config import ModelConfig, load_config
from engine.models.v4.model import DeepseekV4

# Parameters the reference keeps in fp32 whatever the model dtype (substring match on the name).
FP32_MARKERS = ("attn_hc", "ffn_hc", "hc_head", "sinks", "position_bias", "e_score_correction_bias", "norm")

def keeps_fp32(name: str) -> bool:
    return any(marker in name for marker in FP32_MARKERS)


def tensor_dtype(name: str, tensor_or_dtype, model_dtype: torch.dtype) -> torch.dtype:
    """Storage dtype for a parameter: integers unchanged, fp32 markers in fp32, the rest model dtype."""
    dtype = tensor_or_dtype if isinstance(tensor_or_dtype, torch.dtype) else tensor_or_dtype.dtype
    if not dtype.is_floating_point:
        return dtype
    return torch.float32 if keeps_fp32(name) else model_dtype


def build_empty(config: ModelConfig) -> DeepseekV4:
    """The model with parameters on the meta device (no memory), ready for `assign` loading."""
    with torch.device("meta"):
        return DeepseekV4(config)


def load_model(
    model_dir: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None
) -> DeepseekV4:
    """Build the model from `model_dir`; weights are read shard by shard straight to `device`."""
    model_dir = Path(model_dir)
    config = load_config(model_dir)
    model_dtype = parse_dtype(dtype or config.dtype)
    model = build_empty(config)
    expected = dict(model.state_dict())
    loaded: dict[str, torch.Tensor] = {}
    pieces = _ExpertStacks(expected, device, model_dtype)
    for shard in _shards(model_dir):
        with safe_open(str(shard), framework="pt", device="cpu") as f:
            for key in f.keys():
                name = translate(key)
                if name is None:
                    continue  # the MTP layer ships in checkpoints; not built yet
                if isinstance(name, ExpertPiece):
                    pieces.put(name, _stored(key, f.get_tensor(key), torch.float32, shard))
                    continue
                if name not in expected:
                    if key.endswith(("scale", "scale_inv")):
                        raise KeyError(f"{key} in {shard.name} is a quantization scale: quantized V4 checkpoints "
                                       "do not load (dequantize them to bfloat16 or float32)")
                    raise KeyError(f"unexpected parameter {key} in {shard.name}")
                tensor = _stored(key, f.get_tensor(key), expected[name].dtype, shard)
                if tuple(tensor.shape) != tuple(expected[name].shape):
                    raise ValueError(f"{key}: shape {tuple(tensor.shape)} != {tuple(expected[name].shape)}")
                loaded[name] = tensor.to(device=device, dtype=tensor_dtype(name, tensor, model_dtype))
    loaded.update(pieces.finished())
    if config.tie_word_embeddings:  # as transformers ties them: the head is the embedding
        head, embed = loaded.get("lm_head.weight"), loaded["model.embed_tokens.weight"]
        if head is not None and not torch.equal(head.to(embed.dtype), embed):
            raise ValueError("tie_word_embeddings is true but the checkpoint's lm_head differs from its embedding")
        loaded["lm_head.weight"] = embed
    missing = sorted(set(expected) - set(loaded))
    if missing:
        raise KeyError(f"{len(missing)} parameters missing from {model_dir}: {missing[:5]}")
    model.load_state_dict(loaded, strict=True, assign=True)
    return model.eval()


# How a floating tensor may be stored (cast on load); float16 too, as `epd model init --dtype float16` writes.
FLOAT_STORAGE = (torch.float32, torch.bfloat16, torch.float16)


def _stored(key: str, tensor: torch.Tensor, expected: torch.dtype, shard: Path) -> torch.Tensor:
    """The tensor if its stored dtype is one we load for a parameter of dtype `expected`; else an error naming it."""
    if expected.is_floating_point and tensor.dtype not in FLOAT_STORAGE:
        raise ValueError(f"{key} in {shard.name} is {tensor.dtype}: V4 weights load from float32, bfloat16 or "
                         "float16 (quantized V4 checkpoints do not load)")
    if not expected.is_floating_point and tensor.is_floating_point():
        raise ValueError(f"{key} in {shard.name} is {tensor.dtype}, expected integers ({expected})")
    return tensor


class _ExpertStacks:
    """Assembles stacked expert tensors from per-expert checkpoint matrices."""

    def __init__(self, expected: dict, device, model_dtype: torch.dtype):
        self.expected, self.device, self.model_dtype = expected, device, model_dtype
        self.stacks: dict[str, torch.Tensor] = {}
        self.filled: dict[str, int] = {}

    def put(self, piece: ExpertPiece, tensor: torch.Tensor) -> None:
        target = piece.target
        if target not in self.expected:
            raise KeyError(f"unexpected expert weight for {target}")
        if target not in self.stacks:
            shape = self.expected[target].shape
            self.stacks[target] = torch.empty(shape, device=self.device, dtype=self.model_dtype)
            self.filled[target] = 0
        stack = self.stacks[target]
        rows = stack.shape[1] // 2
        view = {"w1": stack[piece.expert, :rows], "w3": stack[piece.expert, rows:], "w2": stack[piece.expert]}
        if tuple(tensor.shape) != tuple(view[piece.kind].shape):
            raise ValueError(f"{target}[{piece.expert}] {piece.kind}: shape {tuple(tensor.shape)}")
        view[piece.kind].copy_(tensor)
        self.filled[target] += tensor.numel()

    def finished(self) -> dict[str, torch.Tensor]:
        for target, stack in self.stacks.items():
            if self.filled[target] != stack.numel():
                raise KeyError(f"{target}: some experts missing from the checkpoint")
        return self.stacks


def _shards(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in names]
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return shards
