"""Test-only: the community BF16 export of a released-format V4.1 directory.

Every quantized weight (FP8 32x32 blocks, MXFP4 experts, FP8 Engram rows) is decoded to bfloat16
with the reference's own decoder (NeMo's `dequantize_checkpoint_weight`, not ours), its `.scale`
dropped, and `quantization_config` removed from config.json; every other tensor is copied as
stored. `restore_tensor` rewrites single tensors of a directory (another dtype, another shape,
removed, added) to build the other storage forms the loader must accept or refuse.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def export_bf16(model_dir: Path, out: Path) -> Path:
    from nemo_automodel.components.models.deepseek_v41.state_dict_adapter import dequantize_checkpoint_weight

    out.mkdir(parents=True)
    for item in model_dir.iterdir():
        if item.suffix != ".safetensors" and item.name != "model.safetensors.index.json":
            shutil.copyfile(item, out / item.name)
    raw = json.loads((model_dir / "config.json").read_text())
    raw.pop("quantization_config", None)
    raw.get("text_config", {}).pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    tensors = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})
    exported = {}
    for key, tensor in tensors.items():
        if key.endswith(".scale"):
            continue
        scale = tensors.get(key.removesuffix(".weight") + ".scale")
        if scale is not None:
            tensor = dequantize_checkpoint_weight(tensor, scale.view(torch.float8_e8m0fnu), dtype=torch.bfloat16,
                                                  rowwise=".engram.embed." in key)
        exported[key] = tensor.contiguous()
    save_file(exported, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def copy_model_dir(model_dir: Path, out: Path) -> Path:
    """A copy of a single-shard model directory, to damage or re-store tensors in."""
    shutil.copytree(model_dir, out)
    return out


def restore_tensor(model_dir: Path, edits: dict[str, torch.Tensor | None]) -> None:
    """Rewrite model.safetensors with each named tensor replaced (None: removed, new names: added)."""
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    for key, tensor in edits.items():
        if tensor is None:
            del tensors[key]
        else:
            tensors[key] = tensor.contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
