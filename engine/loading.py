"""Load whichever model a directory holds: DeepSeek V4 (flat HF config) or V4.1 (`model_type`
`deepseek_v41`, nested `text_config`, the released quantized layout)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def model_arch(model_dir: str | Path) -> str:
    """"v4.1" or "v4", from the directory's config.json."""
    from engine.models.v41.config import is_v41

    raw = json.loads((Path(model_dir) / "config.json").read_text())
    return "v4.1" if is_v41(raw) else "v4"


def load_model(model_dir: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None):
    if model_arch(model_dir) == "v4.1":
        from engine.models.v41.loader import load_v41_model

        return load_v41_model(model_dir, device, dtype)
    from engine.models.v4.loader import load_model as load_v4_model

    return load_v4_model(model_dir, device, dtype)
