"""Test-only: the JSON schemas the structured-output tests run through every API.

Random weights write nonsense, so every leaf is bounded (maxLength, enums, integer ranges, bounded
arrays): under the constraint any output ends within a few hundred tokens, and each must validate.
Together they cover nested objects, enums, arrays with bounds, optional properties, anyOf (a tagged
union too), number ranges, patterns, formats, $ref, const and null. Each node names its `type`, as
OpenAI's strict mode (and deepseek-recipe's check of it) asks; OPTIONAL lists the schemas strict mode
refuses (it wants every property required): they go through APIs without that rule.
"""
from __future__ import annotations

SHORT = {"type": "string", "maxLength": 6}


def strict_object(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, "additionalProperties": False}


SCHEMAS: dict[str, dict] = {
    "flat": strict_object({"name": SHORT, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                           "active": {"type": "boolean"}}),
    "enum": strict_object({"color": {"type": "string", "enum": ["red", "green", "blue"]}}),
    "nested": strict_object({"user": strict_object({"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                    "profile": strict_object({"nick": SHORT,
                                                                              "level": {"type": "string", "enum": ["low", "high"]}})})}),
    "array_bounds": strict_object({"tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]},
                                            "minItems": 1, "maxItems": 3}}),
    "optional": strict_object({"id": {"type": "integer", "minimum": 0, "maximum": 9}, "note": SHORT,
                               "flag": {"type": "boolean"}}, required=["id"]),
    "any_of": strict_object({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, SHORT]}}),
    "integer_range": strict_object({"score": {"type": "integer", "minimum": -50, "maximum": 50},
                                    "exclusive": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}),
    "pattern": strict_object({"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}}),
    "array_of_objects": strict_object({"points": {"type": "array", "maxItems": 2, "items": strict_object(
        {"x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}})}}),
    "nullable": strict_object({"middle": {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "null"}]}}),
    "const": strict_object({"version": {"type": "integer", "const": 2}, "kind": {"type": "string", "const": "point"}}),
    "one_of": strict_object({"shape": {"anyOf": [
        strict_object({"type": {"type": "string", "const": "circle"}, "r": {"type": "integer", "minimum": 1, "maximum": 9}}),
        strict_object({"type": {"type": "string", "const": "square"}, "side": {"type": "integer", "minimum": 1,
                                                                                "maximum": 9}})]}}),
    "deep": strict_object({"a": strict_object({"b": strict_object({"c": strict_object({"d": {"type": "boolean"}})})})}),
    "string_bounds": strict_object({"word": {"type": "string", "minLength": 2, "maxLength": 4}}),
    "fixed_array": strict_object({"pair": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "minItems": 2, "maxItems": 2}}),
    "int_enum": strict_object({"level": {"type": "integer", "enum": [1, 2, 3, 5, 8]}}),
    "refs": {"$defs": {"money": strict_object({"units": {"type": "integer", "minimum": 0, "maximum": 1000},
                                               "currency": {"type": "string", "enum": ["EUR", "USD"]}})},
             **strict_object({"price": {"$ref": "#/$defs/money"}, "discount": {"$ref": "#/$defs/money"}})},
    "many_optional": strict_object({k: {"type": "boolean"} for k in "abcdef"}, required=["a"]),
    "alternation": strict_object({"answer": {"type": "string", "pattern": "^(yes|no|maybe)$"}}),
    "uuid_format": strict_object({"id": {"type": "string", "format": "uuid"}}),
    "number_range": strict_object({"ratio": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25}}),
    "array_of_arrays": strict_object({"grid": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "boolean"}}}}),
}

OPTIONAL = ("optional", "many_optional")
