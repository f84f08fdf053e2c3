"""grammars.py: constraints -> llguidance grammars. Walked token by token with seeded random choices
from each mask, every output must be what the constraint promises: JSON for the schema in the
declared property order, DSML tool calls the gateway's parser accepts with valid arguments."""
from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest

from messages.errors import InvalidRequest
from services.gateway.adapter.tool_calls import V4_TAGS, V41_TAGS, DsmlSyntax
from services.grammar_compiler.grammars import build_grammar

EOS = 1
POINT = {"type": "object", "properties": {"zeta": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "alpha": {"type": "string", "maxLength": 4},
                                          "mid": {"type": "string", "enum": ["x", "y"]}},
         "required": ["zeta", "alpha"], "additionalProperties": False}
TOOLS = [{"name": "get_point", "schema": POINT, "strict": True},
         {"name": "noargs", "schema": {"type": "object", "properties": {}}, "strict": False}]


def walk(tokenizer, grammar: str, seed: int, prefix: str = "", limit: int = 300) -> tuple[str, bool]:
    """(text, ended) of a random walk through `grammar`; ended: EOS was allowed and taken, or the
    grammar completed."""
    from llguidance import LLMatcher
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    if prefix:
        assert matcher.consume_tokens(tokenizer.tokenize_str(prefix)), matcher.get_error()
    rng, out = random.Random(seed), []
    for _ in range(limit):
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[:tokenizer.vocab_size]).tolist()
        token = EOS if EOS in allowed and rng.random() < 0.5 else rng.choice(allowed)
        if token == EOS:
            return tokenizer.decode_str(out), True
        out.append(token)
        assert matcher.consume_token(token), matcher.get_error()
        if matcher.is_stopped():
            return tokenizer.decode_str(out), True
    return tokenizer.decode_str(out), False


def calls(text: str, tags=V41_TAGS) -> list[tuple[str, dict]]:
    """The tool calls of a DSML block, checked by the gateway's own parser, with their arguments."""
    syntax = DsmlSyntax("｜DSML｜", tags)
    body = text[text.index(syntax.open) + len(syntax.open):text.index(syntax.close)]
    items = syntax.split_block(body, frozenset(t["name"] for t in TOOLS), complete=True)
    assert all(not item.problem for item in items), [(i.raw, i.problem) for i in items]
    out = []
    for item in items:
        args = {}
        for name, is_string, value in syntax._param.findall(item.raw):
            args[name] = value if is_string == "true" else json.loads(value)
        out.append((item.name, args))
    return out


@pytest.mark.parametrize("seed", range(3))
def test_a_schema_walk_validates_in_the_declared_property_order(llg_tokenizer, seed):
    text, ended = walk(llg_tokenizer, build_grammar({"kind": "json_schema", "schema": POINT, "strict": True}), seed)
    value = json.loads(text)
    jsonschema.validate(value, POINT)
    assert ended and list(value) == [k for k in POINT["properties"] if k in value]
    assert text.startswith('{"zeta": ')   # the model's own spelling: ", " and ": ", nothing else


@pytest.mark.parametrize("mode,tags", [("required", "v4.1"), ("named", "v4.1"), ("required", "v4")])
def test_forced_calls_are_dsml_with_valid_arguments(llg_tokenizer, mode, tags):
    constraint = {"kind": "tool_calls", "mode": mode, "name": "get_point", "tags": tags, "tools": TOOLS}
    for seed in range(3):
        text, ended = walk(llg_tokenizer, build_grammar(constraint), seed)
        made = calls(text, V41_TAGS if tags == "v4.1" else V4_TAGS)
        assert ended and made and text.startswith("<｜DSML｜")
        for name, args in made:
            if name == "get_point":
                jsonschema.validate(args, POINT)
        if mode == "named":
            assert [name for name, _ in made] == ["get_point"]


def test_one_call_only_when_calls_may_not_run_in_parallel(llg_tokenizer):
    constraint = {"kind": "tool_calls", "mode": "required", "tags": "v4.1", "tools": TOOLS, "parallel": False}
    assert all(len(calls(walk(llg_tokenizer, build_grammar(constraint), seed)[0])) == 1 for seed in range(4))


def test_an_optional_call_may_follow_text_and_a_block_opened_by_the_prompt_continues(llg_tokenizer):
    optional = build_grammar({"kind": "tool_calls", "mode": "optional", "tags": "v4.1", "tools": TOOLS})
    said = 'Let me check: a < b.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="noargs">\n'
    text, ended = walk(llg_tokenizer, optional, 0, prefix=said)
    assert ended and calls(said + text)[0] == ("noargs", {})
    assert walk(llg_tokenizer, optional, 1, prefix="plain answer")[1]   # text alone is an answer
    opened = build_grammar({"kind": "tool_calls", "mode": "required", "tags": "v4.1", "tools": TOOLS, "opened": True})
    text, ended = walk(llg_tokenizer, opened, 2)
    assert ended and calls("<｜DSML｜ calls>\n" + text)


@pytest.mark.parametrize("constraint,says", [
    ({"kind": "regex"}, "unknown constraint kind"),
    ({"kind": "json_schema", "schema": []}, "schema as a JSON object"),
    ({"kind": "tool_calls", "mode": "sometimes", "tools": TOOLS}, "mode"),
    ({"kind": "tool_calls", "mode": "required", "tools": []}, "at least one tool"),
    ({"kind": "tool_calls", "mode": "named", "name": "nope", "tools": TOOLS}, "not a declared tool"),
    ({"kind": "tool_calls", "mode": "required", "tools": [{"name": 'say "hi"'}]}, "cannot be written in DSML"),
    ({"kind": "tool_calls", "mode": "required", "tools": [{"name": "f", "schema": {"type": "array"}}]}, "object"),
    ({"kind": "tool_calls", "mode": "required", "tools": [
        {"name": "f", "schema": {"type": "object", "properties": {}, "required": ["x"]}}]}, "not in properties"),
])
def test_malformed_constraints_are_invalid_requests(constraint, says):
    with pytest.raises(InvalidRequest, match=says):
        build_grammar(constraint)
