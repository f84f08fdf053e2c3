"""Load whichever model a directory holds: DeepSeek V4 (flat HF config) or V4.1 (`model_type`
`deepseek_v41`, nested `text_config`; the released quantized layout, tensors stored in float32 or
bfloat16, or a dequantized BF16 export: engine/models/v41/checkpoint.py); check one built elsewhere."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.models.common.dtypes import parse_dtype
from engine.models.spec import ModelSpec


def model_arch(model_dir: str | Path) -> str:
    """"v4.1" or "v4", from the directory's config.json."""
    from engine.models.v41.config import is_v41

    raw = json.loads((Path(model_dir) / "config.json").read_text())
    return "v4.1" if is_v41(raw) else "v4"


def load_model(model_dir: str | Path, device: str | torch.device = "cpu",
               dtype: str | torch.dtype | None = None) -> ModelSpec:
    if model_arch(model_dir) == "v4.1":
        from engine.models.v41.loader import load_v41_model

        return load_v41_model(model_dir, device, dtype)
    from engine.models.v4.loader import load_model as load_v4_model

    return load_v4_model(model_dir, device, dtype)


def check_built_model(model: ModelSpec, device: str | torch.device, dtype: str | torch.dtype | None) -> None:
    """A model handed to an engine must be on `device` and, when `dtype` is set, in it: the engine
    allocates its KV there and in the model's dtype."""
    wanted = torch.device(device)
    if model.device.type != wanted.type or (wanted.index is not None and model.device.index != wanted.index):
        raise ValueError(f"the model is on {model.device}, the engine config says device {str(device)!r}")
    if dtype is not None and model.dtype != parse_dtype(dtype):
        raise ValueError(f"the model runs in {model.dtype}, the engine config says dtype {str(dtype)!r}")
