"""The constraints `epd bench grammar` compiles, one per schema class, as the gateway would send them.

Every object is closed (additionalProperties false), with all its properties required but in the
optional-properties class, so llguidance and xgrammar enforce the same language whatever their
defaults for unlisted properties.

The two pathological classes each hit one library where it is weak (found by trial, 2-core box):
  regex repetition  a string whose pattern repeats a bounded group (`([a-z0-9]{1,20}-){20}`):
                    xgrammar expands the repetition and precomputes token masks for every copy
                    (~2.6 s and a 12 MB artifact at 20 copies, ~9 s at 50); llguidance's lazy lexer
                    builds only what the first mask needs (~6 ms).
  optional props    an object of 2,000 optional integer properties: llguidance's "any subset, in
                    order" grammar takes ~1 s to build (~30 s at 10,000) and passes the compile check
                    (first mask), then refuses the first token its mask allows: the parser's row limit
                    (2,000 items, 4 per optional property: over ~500 properties). xgrammar passes
                    the 10 s limit (~7 s and 356 MB already at 1,000).
Left out for its run time (~10 s more): nested anyOf (object-or-array, 9-10 levels) compiles in
xgrammar in 0.6-1.7 s, but serializing it needs more than 4 GiB (std::bad_alloc at the bench's
cap; without one, past 22 GB and killed by the kernel); llguidance: 0.2-0.8 s, 71-142 KB.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    name: str
    what: str            # one line for the tables
    constraint: dict
    pathological: bool = False


def closed(properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def simple_schema() -> dict:
    return closed({"name": {"type": "string"}, "age": {"type": "integer"}, "active": {"type": "boolean"}})


def nested_schema() -> dict:
    """Objects in arrays in objects, three levels deep."""
    item = closed({"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
                   "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}})
    order = closed({"id": {"type": "string"}, "items": {"type": "array", "items": item, "minItems": 1},
                    "total": {"type": "number"}})
    return closed({"customer": closed({"name": {"type": "string"}, "email": {"type": "string"}}),
                   "orders": {"type": "array", "items": order}})


def enum_schema(values: int = 1000) -> dict:
    return closed({"city": {"enum": [f"city-{i:04d}-{_word(i)}" for i in range(values)]}})


def tool_set(tools: int = 20) -> dict:
    """`tools` strict tools, each with a few typed parameters; a tool call is required."""
    specs = []
    for i in range(tools):
        schema = closed({"query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1, "maximum": 100},
                         "mode": {"enum": ["fast", "exact", f"mode{i}"]},
                         "filters": {"type": "array", "items": closed({"field": {"type": "string"},
                                                                       "value": {"type": "string"}})}})
        specs.append({"name": f"tool_{i:02d}_{_word(i)}", "schema": schema, "strict": True})
    return {"kind": "tool_calls", "mode": "required", "name": None, "tags": "v4.1", "opened": False,
            "parallel": True, "tools": specs}


def regex_repetition_schema(copies: int = 20) -> dict:
    return closed({"slug": {"type": "string", "pattern": "^([a-z0-9]{1,20}-){%d}$" % copies}})


def optional_properties_schema(count: int = 2000) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(count)},
            "additionalProperties": False}


def cases(regex_copies: int = 20, optional_count: int = 2000) -> list[Case]:
    def schema(s: dict) -> dict:
        return {"kind": "json_schema", "schema": s, "strict": True}
    return [
        Case("simple", "3 fields", schema(simple_schema())),
        Case("nested", "objects in arrays in objects, 3 levels", schema(nested_schema())),
        Case("enum", "one enum of 1,000 values", schema(enum_schema())),
        Case("tools", "20 strict tools, tool_calls required (DSML v4.1)", tool_set()),
        Case("patho-regex", f"pattern ([a-z0-9]{{1,20}}-){{{regex_copies}}}",
             schema(regex_repetition_schema(regex_copies)), pathological=True),
        Case("patho-optional", f"{optional_count:,} optional properties",
             schema(optional_properties_schema(optional_count)), pathological=True),
    ]


def _word(i: int) -> str:
    """A pronounceable, distinct tail: real enum values and tool names are words, not numbers."""
    out = []
    for _ in range(3):
        i, r = divmod(i, 70)
        out.append("bdfgklmnprstvz"[r % 14] + "aeiou"[r // 14])
    return "".join(out)
