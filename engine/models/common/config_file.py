"""Find and read a model's `config.json`: a bundled name (engine/configs), a JSON file or a directory."""

from __future__ import annotations

import json
from pathlib import Path

BUNDLED_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def read_config_dict(name_or_path: str | Path) -> dict:
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    elif not path.exists() and (BUNDLED_CONFIGS / f"{name_or_path}.json").exists():
        path = BUNDLED_CONFIGS / f"{name_or_path}.json"
    if not path.exists():
        raise FileNotFoundError(f"no model config at {name_or_path!r}")
    return json.loads(path.read_text())
