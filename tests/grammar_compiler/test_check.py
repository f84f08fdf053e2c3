"""check.py: unenforceable keywords and formats are refused by name when strict and compile when
lenient; other grammar errors are INVALID_REQUEST; the enforceable lists match the installed library."""
from __future__ import annotations

import pytest
from llguidance import LLMatcher

from messages.errors import GrammarUnsupported, InvalidRequest
from messages.grammar import constraint_json
from services.grammar_compiler.check import (ENFORCEABLE_FORMATS, ENFORCEABLE_KEYWORDS, check_grammar,
                                             compile_constraint)
from tests.grammar_compiler.test_helper_constraints import SIMPLE_SCHEMA, json_schema

NOT_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}}
FORMAT_SCHEMA = {"type": "object", "properties": {"id": {"type": "string", "format": "int32"}}}

# One schema per keyword, each valid on its own (strict compile must accept every enforceable one).
KEYWORD_SAMPLES = {
    "anyOf": [{"type": "string"}, {"type": "null"}], "oneOf": [{"type": "string"}, {"type": "null"}],
    "allOf": [{"type": "string"}], "$ref": "#/$defs/a", "const": 1, "enum": [1, "a"], "type": "string",
    "items": {"type": "string"}, "additionalItems": {"type": "string"}, "prefixItems": [{"type": "string"}],
    "minItems": 1, "maxItems": 2, "properties": {"a": {"type": "string"}}, "additionalProperties": False,
    "patternProperties": {"^a": {"type": "string"}}, "required": ["a"], "minProperties": 1, "maxProperties": 2,
    "minLength": 1, "maxLength": 2, "pattern": "^a+$", "format": "date", "minimum": 1, "maximum": 2,
    "exclusiveMinimum": 0, "exclusiveMaximum": 5, "multipleOf": 2,
}
UNENFORCEABLE_SAMPLES = {
    "not": {"type": "string"}, "if": {"type": "string"}, "then": {"type": "string"}, "else": {"type": "string"},
    "uniqueItems": True, "contains": {"type": "string"}, "minContains": 1, "maxContains": 2,
    "propertyNames": {"pattern": "^a"}, "dependentRequired": {"a": ["b"]}, "dependentSchemas": {"a": {}},
    "unevaluatedProperties": False, "unevaluatedItems": False,
}


def test_a_simple_schema_compiles_to_the_library_grammar_text(llg_tokenizer):
    grammar, compile_ms = compile_constraint(json_schema(SIMPLE_SCHEMA), llg_tokenizer)
    assert grammar.startswith('{"grammars"') and '"additionalProperties":false' in grammar
    assert LLMatcher.validate_grammar(grammar, llg_tokenizer) == ""
    assert 0 < compile_ms < 1000


def test_json_object_compiles(llg_tokenizer):
    grammar, _ = compile_constraint(constraint_json({"kind": "json_object"}), llg_tokenizer)
    assert '"type":"object"' in grammar


def test_strict_refuses_not_naming_the_keyword_and_what_is_enforceable(llg_tokenizer):
    with pytest.raises(GrammarUnsupported) as refused:
        compile_constraint(json_schema(NOT_SCHEMA, strict=True), llg_tokenizer)
    assert refused.value.message.startswith(
        "the JSON schema keyword 'not' is not supported (enforceable keywords: anyOf")
    assert "multipleOf" in refused.value.message


def test_strict_names_every_unenforceable_keyword_of_one_schema(llg_tokenizer):
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "contains": {"const": 1}}
    with pytest.raises(GrammarUnsupported,
                       match="^the JSON schema keywords 'contains', 'uniqueItems' are not supported"):
        compile_constraint(json_schema(schema), llg_tokenizer)


def test_strict_refuses_an_unknown_format_by_name(llg_tokenizer):
    with pytest.raises(GrammarUnsupported) as refused:
        compile_constraint(json_schema(FORMAT_SCHEMA, strict=True), llg_tokenizer)
    assert refused.value.message.startswith("the JSON schema string format 'int32' is not supported")
    assert "date-time" in refused.value.message


@pytest.mark.parametrize("schema", [NOT_SCHEMA, FORMAT_SCHEMA], ids=["not", "format"])
def test_lenient_compiles_what_strict_refuses(llg_tokenizer, schema):
    grammar, _ = compile_constraint(json_schema(schema, strict=False), llg_tokenizer)
    assert '"lenient":true' in grammar


def test_strict_check_refuses_a_lenient_grammar_whose_warnings_name_an_unenforced_keyword(llg_tokenizer):
    lenient = LLMatcher.grammar_from_json_schema(NOT_SCHEMA, overrides={"lenient": True})
    check_grammar(lenient, llg_tokenizer, strict=False)
    with pytest.raises(GrammarUnsupported, match="'not'"):
        check_grammar(lenient, llg_tokenizer, strict=True)


@pytest.mark.parametrize("constraint, detail", [
    (json_schema({"type": "string", "pattern": "(("}), "regex parse error"),
    (json_schema({"type": "strang"}), "Invalid type: strang"),
    # past a library limit (the lexer's fuel): refused at once rather than compiled slowly
    (json_schema({"type": "string", "pattern": "^(.*a.*b.*c.*d.*e.*f.*g.*h.*)$", "minLength": 200,
                  "maxLength": 4000}), "Unable to determine if regex is empty"),
    ('{"kind": ', "not valid JSON"),
    (constraint_json({"kind": "regex"}), "unknown constraint kind"),
], ids=["bad-regex", "bad-type", "lexer-limit", "not-json", "unknown-kind"])
def test_other_failures_are_invalid_request_with_the_reason(llg_tokenizer, constraint, detail):
    with pytest.raises(InvalidRequest, match=detail) as refused:
        compile_constraint(constraint, llg_tokenizer)
    assert "\n" not in refused.value.message


def test_enforceable_lists_match_the_installed_library(llg_tokenizer):
    """A library upgrade that enforces more (or less) shows here, so the refusals never lie."""
    assert set(KEYWORD_SAMPLES) == set(ENFORCEABLE_KEYWORDS)
    for keyword, value in KEYWORD_SAMPLES.items():
        schema = {keyword: value, **({"$defs": {"a": {"type": "string"}}} if keyword == "$ref" else {})}
        compile_constraint(json_schema(schema), llg_tokenizer)
    for keyword, value in UNENFORCEABLE_SAMPLES.items():
        with pytest.raises(GrammarUnsupported, match=f"keyword '{keyword}' is not supported"):
            compile_constraint(json_schema({keyword: value}), llg_tokenizer)
    for fmt in ENFORCEABLE_FORMATS:
        compile_constraint(json_schema({"type": "string", "format": fmt}), llg_tokenizer)
    for fmt in ("uri-reference", "regex", "int64", "password"):
        with pytest.raises(GrammarUnsupported, match=f"format '{fmt}'"):
            compile_constraint(json_schema({"type": "string", "format": fmt}), llg_tokenizer)
