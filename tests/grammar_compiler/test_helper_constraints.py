"""Test-only: constraints and the tokenizer the grammar compiler tests use."""
from __future__ import annotations

from pathlib import Path

from engine.models.v41.tokenizer_file import v4_tokenizer_json
from messages.grammar import constraint_json

SIMPLE_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                 "required": ["name", "age"], "additionalProperties": False}
# 10,000 optional properties: llguidance spends ~30 s on it (2-core box: 5 s validating, 26 s
# building the matcher and its first mask), far past any test's compile_timeout_s.
SLOW_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(10_000)}}


def json_schema(schema: dict, strict: bool = True) -> str:
    """The canonical json_schema constraint, as the gateway sends it."""
    return constraint_json({"kind": "json_schema", "schema": schema, "strict": strict})


def tokenizer_json() -> Path:
    """The V4 tokenizer.json every tiny model directory ships."""
    return v4_tokenizer_json()
