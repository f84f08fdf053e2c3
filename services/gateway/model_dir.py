"""What the gateway reads from the served model's directory: its prompt encoding and context.

The encoding follows the model, not a flag: config.json with `model_type == "deepseek_v41"` (the
nested HF layout, whose `text_config` has `model_type == "deepseek_v41_text"`; either one is
enough) is V4.1, anything else is V4. A configured encoding that disagrees with the directory
is an error at start: serving V4.1 weights with V4 prompts (or the reverse) would run, and answer
badly, without any other sign.
"""
from __future__ import annotations

import json
from pathlib import Path

V41_MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")


def read_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"gateway: {path} does not exist") from None
    if not isinstance(raw, dict):
        raise ValueError(f"gateway: {path} is not a JSON object")
    return raw


def encoding_of(raw: dict) -> str:
    """ "v4.1" or "v4" for a parsed config.json."""
    text = raw.get("text_config")
    types = {raw.get("model_type"), text.get("model_type") if isinstance(text, dict) else None}
    return "v4.1" if types & set(V41_MODEL_TYPES) else "v4"


def served_encoding(model_dir: str, configured: str = "") -> str:
    """The encoding to serve: the model directory's; `configured` ("" = none) must agree with it.
    Without a model directory, the configured one (default V4)."""
    if not model_dir:
        return configured or "v4"
    found = encoding_of(read_config(model_dir))
    if configured and configured != found:
        raise ValueError(f"gateway: settings.encoding is {configured!r} but {model_dir}/config.json "
                         f"is a {found} model; drop the setting or fix the model directory")
    return found


def context_length(model_dir: str) -> int:
    """max_position_embeddings (in text_config for V4.1's nested layout); 4096 if absent."""
    if not model_dir:
        raise ValueError("gateway: set settings.model_dir (or settings.context_length)")
    raw = read_config(model_dir)
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    return int(raw.get("max_position_embeddings") or text.get("max_position_embeddings") or 4096)


def vision_sizing(model_dir: str):
    """The image sizing rule (messages.images.VisionSizing) of a model with a vision encoder
    (`vision_config.num_hidden_layers` > 0), else None: its requests with images are refused."""
    from messages.images import VisionSizing
    if not model_dir:
        return None
    raw = read_config(model_dir)
    vision = raw.get("vision_config")
    if encoding_of(raw) != "v4.1" or not isinstance(vision, dict) or not vision.get("num_hidden_layers", 32):
        return None
    return VisionSizing.from_config(raw)
