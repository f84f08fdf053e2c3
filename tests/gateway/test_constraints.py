"""The output constraint each protocol's request asks for (services/gateway/adapter/constraints.py),
as the grammar the worker gets: its kind, schema and strictness, the tool-call mode and tool set, the
DSML tag spelling of the model, whether the prompt already opened the call block, and where the
constraint starts (after `</think>` in thinking mode). What cannot be enforced is a 400 naming it."""
from __future__ import annotations

import json

import pytest

from messages.grammar import constraint_json, constraint_key, tokenizer_id
from services.gateway.adapter import GatewayError, Protocol
from services.gateway.adapter.constraints import constraint_of
from tests.gateway.conftest import (
    BODY, MODEL, V41_MODEL, WEATHER_SCHEMA, chat_body, messages_body, responses_body, weather_tools,
)

C, R, M = Protocol.CHAT, Protocol.RESPONSES, Protocol.MESSAGES
THINK_END_ID = 128822                                  # `</think>` in the V4 and V4.1 vocabularies
OFF = {C: {"thinking": {"type": "disabled"}}, R: {"reasoning": {"effort": "none"}},
       M: {"thinking": {"type": "disabled"}}}          # forced tool choices convert only without thinking
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}
OTHER_SCHEMA = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"],
                "additionalProperties": False}
JSON_PROMPT = [{"role": "user", "content": "Answer in json."}]


def two_tools(protocol: Protocol, strict_other: bool = False) -> list[dict]:
    """get_weather (WEATHER_SCHEMA, not strict) and search (OTHER_SCHEMA, strict if asked)."""
    other = {"name": "search", "description": "Search.", "strict": strict_other}
    if protocol is C:
        return weather_tools(C) + [{"type": "function", "function": {**other, "parameters": OTHER_SCHEMA}}]
    if protocol is R:
        return weather_tools(R) + [{"type": "function", **other, "parameters": OTHER_SCHEMA}]
    return weather_tools(M) + [{**other, "input_schema": OTHER_SCHEMA}]


def strict_search(protocol: Protocol) -> list[dict]:
    """search alone, strict (OpenAI refuses strict and non-strict tools in one request)."""
    return two_tools(protocol, strict_other=True)[1:]


def tool_specs(strict_other: bool = False) -> list[dict]:
    return [{"name": "get_weather", "schema": WEATHER_SCHEMA, "strict": False},
            {"name": "search", "schema": OTHER_SCHEMA, "strict": strict_other}]


def calls(mode: str, name: str | None = None, tools=None, parallel=True, tags="v4", opened=True) -> dict:
    return {"kind": "tool_calls", "mode": mode, "name": name, "tools": tools or tool_specs(), "parallel": parallel,
            "tags": tags, "opened": opened}


def constraint(prepared) -> dict:
    assert prepared.grammar is not None
    return json.loads(prepared.grammar.constraint)


# ---- output formats ------------------------------------------------------------------------------

FORMATS = [
    ("chat json_object", C, chat_body(messages=JSON_PROMPT, response_format={"type": "json_object"}),
     {"kind": "json_object"}),
    ("chat json_schema strict", C, chat_body(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA, "strict": True}}), {"kind": "json_schema", "schema": SCHEMA, "strict": True}),
    ("chat json_schema lenient", C, chat_body(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA}}), {"kind": "json_schema", "schema": SCHEMA, "strict": False}),
    ("responses json_schema strict", R, responses_body(text={"format": {
        "type": "json_schema", "name": "x", "schema": SCHEMA, "strict": True}}),
     {"kind": "json_schema", "schema": SCHEMA, "strict": True}),
    ("responses json_object", R, responses_body(input="Answer in json.", text={"format": {"type": "json_object"}}),
     {"kind": "json_object"}),
    ("messages output_format", M, messages_body(output_format={"type": "json_schema", "schema": SCHEMA}),
     {"kind": "json_schema", "schema": SCHEMA, "strict": True}),
    ("messages output_config.format", M, messages_body(output_config={"format": {
        "type": "json_schema", "schema": SCHEMA}}), {"kind": "json_schema", "schema": SCHEMA, "strict": True}),
]


@pytest.mark.parametrize("label,protocol,body,expected", FORMATS, ids=[f[0] for f in FORMATS])
def test_output_formats_become_json_constraints(adapter, label, protocol, body, expected):
    assert constraint(adapter.prepare(protocol, body)) == expected


# ---- tool calls ----------------------------------------------------------------------------------

TOOL_CALLS = [
    ("chat required", C, chat_body(tools=two_tools(C), tool_choice="required", **OFF[C]), calls("required")),
    ("chat named, one call", C, chat_body(tools=two_tools(C), parallel_tool_calls=False, **OFF[C], tool_choice={
        "type": "function", "function": {"name": "search"}}), calls("named", "search", parallel=False)),
    ("chat auto with a strict tool", C, chat_body(tools=strict_search(C)),
     calls("optional", tools=tool_specs(strict_other=True)[1:], opened=False)),
    ("responses required, one call", R, responses_body(tools=two_tools(R), tool_choice="required",
                                                      parallel_tool_calls=False, **OFF[R]),
     calls("required", parallel=False)),
    ("responses named", R, responses_body(tools=two_tools(R), **OFF[R], tool_choice={
        "type": "function", "name": "get_weather"}), calls("named", "get_weather")),
    ("responses auto with a strict tool", R, responses_body(tools=strict_search(R), tool_choice="auto"),
     calls("optional", tools=tool_specs(strict_other=True)[1:], opened=False)),
    # In thinking mode the prompt ends in <think>: the call block is not open yet.
    ("messages any", M, messages_body(tools=two_tools(M), tool_choice={"type": "any"}),
     calls("required", opened=False)),
    ("messages any, one call", M, messages_body(tools=two_tools(M), tool_choice={
        "type": "any", "disable_parallel_tool_use": True}), calls("required", parallel=False, opened=False)),
    ("messages tool", M, messages_body(tools=two_tools(M), **OFF[M], tool_choice={"type": "tool", "name": "search"}),
     calls("named", "search")),
    ("messages auto with a strict tool", M, messages_body(tools=two_tools(M, strict_other=True),
                                                          tool_choice={"type": "auto"}),
     calls("optional", tools=tool_specs(strict_other=True), opened=False)),
    ("v4.1 chat required", C, chat_body(model=V41_MODEL, tools=two_tools(C), tool_choice="required", **OFF[C]),
     calls("required", tags="v4.1")),
    ("v4.1 messages any", M, messages_body(model=V41_MODEL, tools=two_tools(M), tool_choice={"type": "any"}),
     calls("required", tags="v4.1", opened=False)),
]


@pytest.mark.parametrize("label,protocol,body,expected", TOOL_CALLS, ids=[t[0] for t in TOOL_CALLS])
def test_forced_and_strict_tool_calls_become_tool_call_constraints(adapter, label, protocol, body, expected):
    prepared = adapter.prepare(protocol, body)
    assert constraint(prepared) == expected
    assert expected["opened"] == prepared.response.parsing.starts_in_tool_calls   # the prompt's own state


def test_the_opened_block_is_the_one_the_prompt_ends_with(adapter):
    for model, opening in ((MODEL, "<｜DSML｜tool_calls>\n"), (V41_MODEL, "<｜DSML｜ calls>\n")):
        prepared = adapter.prepare(C, chat_body(model=model, tools=two_tools(C), tool_choice="required", **OFF[C]))
        assert prepared.response.table.decode(prepared.prompt_ids).endswith(opening)
        assert constraint(prepared)["opened"] is True


def test_a_tool_without_parameters_takes_an_empty_object(adapter):
    tools = [{"type": "function", "function": {"name": "ping", "description": "Ping."}}]
    prepared = adapter.prepare(C, chat_body(tools=tools, tool_choice="required", **OFF[C]))
    assert constraint(prepared)["tools"] == [{"name": "ping", "schema": {"type": "object", "properties": {}},
                                             "strict": False}]


# ---- allowed_tools (the library refuses the parameter today: constraint_of is called directly) ------

def plain_parsing(adapter):
    return adapter.prepare(C, chat_body(**OFF[C])).response.parsing


ALLOWED = [
    ("chat required", C, {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "search"}}]}}, "required", False),
    ("responses required", R, {"type": "allowed_tools", "mode": "required", "tools": [
        {"type": "function", "name": "search"}]}, "required", False),
    ("responses auto, strict subset", R, {"type": "allowed_tools", "mode": "auto", "tools": [
        {"type": "function", "name": "search"}]}, "optional", True),
]


@pytest.mark.parametrize("label,protocol,choice,mode,strict_other", ALLOWED, ids=[a[0] for a in ALLOWED])
def test_allowed_tools_narrow_the_constraint_to_their_subset(adapter, label, protocol, choice, mode, strict_other):
    payload = {"tools": two_tools(protocol, strict_other), "tool_choice": choice}
    got = constraint_of(protocol, payload, plain_parsing(adapter))
    assert got["mode"] == mode and got["tools"] == tool_specs(strict_other)[1:]


def test_allowed_tools_naming_no_declared_tool_are_a_400(adapter):
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "nope"}]}
    with pytest.raises(GatewayError) as caught:
        constraint_of(R, {"tools": two_tools(R), "tool_choice": choice}, plain_parsing(adapter))
    assert caught.value.status == 400 and caught.value.param == "tool_choice"


def test_allowed_tools_are_refused_by_the_library_before_any_constraint(adapter):
    """reproduces deepseek-recipe 0.2.0: when it accepts them, the cases above become reachable."""
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "search"}]}
    with pytest.raises(GatewayError) as caught:
        adapter.prepare(R, responses_body(tools=two_tools(R), tool_choice=choice, **OFF[R]))
    assert caught.value.status == 400 and "allowed_tools" in caught.value.message


# ---- where the constraint starts, and the reference the worker gets ------------------------------

@pytest.mark.parametrize("model", [MODEL, V41_MODEL])
def test_in_thinking_mode_the_constraint_starts_after_the_think_end_token(adapter, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    thinking = adapter.prepare(C, chat_body(model=model, response_format=fmt))
    assert thinking.response.table.added_ids["</think>"] == THINK_END_ID
    assert thinking.grammar.after_token == THINK_END_ID
    assert adapter.prepare(C, chat_body(model=model, response_format=fmt, **OFF[C])).grammar.after_token == -1
    forced = adapter.prepare(M, messages_body(model=model, tools=two_tools(M), tool_choice={"type": "any"}))
    assert forced.grammar.after_token == THINK_END_ID


def test_the_grammar_reference_is_keyed_by_tokenizer_and_canonical_constraint(adapter, v41_tokenizer_path):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    v4 = adapter.prepare(C, chat_body(response_format=fmt)).grammar
    v41 = adapter.prepare(C, chat_body(model=V41_MODEL, response_format=fmt)).grammar
    assert v41.tokenizer_id == tokenizer_id(v41_tokenizer_path) != v4.tokenizer_id
    for ref in (v4, v41):
        assert ref.constraint == constraint_json(json.loads(ref.constraint))   # canonical spelling
        assert ref.key == constraint_key(ref.tokenizer_id, ref.constraint)
        assert ref.compiler == "" and ref.replay == []                          # the gateway names its compiler
    assert v4.constraint == v41.constraint and v4.key != v41.key


# ---- free text: no grammar -----------------------------------------------------------------------

PLAIN = [
    ("chat", C, chat_body()), ("responses", R, responses_body()), ("messages", M, messages_body()),
    ("chat text format", C, chat_body(response_format={"type": "text"})),
    ("responses text format", R, responses_body(text={"format": {"type": "text"}})),
    ("chat auto tools", C, chat_body(tools=two_tools(C), tool_choice="auto")),
    ("responses default tools", R, responses_body(tools=two_tools(R))),
    ("messages auto tools", M, messages_body(tools=two_tools(M), tool_choice={"type": "auto"})),
    ("chat none with a strict tool", C, chat_body(tools=strict_search(C), tool_choice="none")),
    ("responses none with a strict tool", R, responses_body(tools=strict_search(R), tool_choice="none")),
    ("messages none with a strict tool", M, messages_body(tools=two_tools(M, strict_other=True),
                                                          tool_choice={"type": "none"})),
]


@pytest.mark.parametrize("label,protocol,body", PLAIN, ids=[p[0] for p in PLAIN])
def test_free_text_requests_carry_no_grammar(adapter, label, protocol, body):
    prepared = adapter.prepare(protocol, body)
    assert prepared.grammar is None and prepared.generate_request().grammar is None


# ---- what cannot be enforced ---------------------------------------------------------------------

FORMAT_AND_CALL = "a structured output format together with a forced or strict tool call"
REFUSED = [
    # (label, protocol, body, param or None where the library refuses first, words in the message)
    ("chat unknown format type", C, chat_body(response_format={"type": "regex", "regex": "a+"}),
     "response_format", "'regex' is not supported"),
    ("responses unknown format type", R, responses_body(text={"format": {"type": "regex"}}), None, "regex"),
    ("messages format other than json_schema", M, messages_body(output_format={"type": "json_object"}),
     "output_format", "output_format must be {type: json_schema"),
    ("messages output_config.format other than json_schema", M,
     messages_body(output_config={"format": {"type": "text"}}), "output_config.format", "output_config.format must be"),
    ("chat json_schema without a schema", C, chat_body(response_format={"type": "json_schema", "json_schema": {
        "name": "x"}}), None, "schema"),
    ("responses json_schema without a schema", R, responses_body(text={"format": {"type": "json_schema", "name": "x"}}),
     None, "schema"),
    ("messages json_schema without a schema", M, messages_body(output_format={"type": "json_schema"}),
     "output_format.schema", "must be a JSON schema object"),
    ("messages json_schema that is not an object", M, messages_body(output_config={"format": {
        "type": "json_schema", "schema": "x"}}), "output_config.format.schema", "must be a JSON schema object"),
    ("chat named tool not declared", C, chat_body(tools=two_tools(C), **OFF[C], tool_choice={
        "type": "function", "function": {"name": "nope"}}), None, "'nope'"),
    ("responses named tool not declared", R, responses_body(tools=two_tools(R), **OFF[R], tool_choice={
        "type": "function", "name": "nope"}), None, "'nope'"),
    ("messages named tool not declared", M, messages_body(tools=two_tools(M), **OFF[M], tool_choice={
        "type": "tool", "name": "nope"}), None, "'nope'"),
    ("chat format with a forced call", C, chat_body(tools=two_tools(C), tool_choice="required", **OFF[C],
                                                    response_format={"type": "json_schema", "json_schema": {
                                                        "name": "x", "schema": SCHEMA}}),
     "tool_choice", FORMAT_AND_CALL),
    ("responses format with a forced call", R, responses_body(tools=two_tools(R), tool_choice="required", **OFF[R],
                                                              text={"format": {"type": "json_schema", "name": "x",
                                                                               "schema": SCHEMA}}),
     "tool_choice", FORMAT_AND_CALL),
    ("messages format with a forced call", M, messages_body(tools=two_tools(M), tool_choice={"type": "any"},
                                                            output_format={"type": "json_schema", "schema": SCHEMA}),
     "tool_choice", FORMAT_AND_CALL),
    ("messages format with a strict tool", M, messages_body(tools=two_tools(M, strict_other=True),
                                                            output_format={"type": "json_schema", "schema": SCHEMA}),
     "tool_choice", FORMAT_AND_CALL),
]


@pytest.mark.parametrize("label,protocol,body,param,words", REFUSED, ids=[r[0] for r in REFUSED])
def test_what_cannot_be_enforced_is_a_400_naming_it(adapter, label, protocol, body, param, words):
    with pytest.raises(GatewayError) as caught:
        adapter.prepare(protocol, body)
    error = caught.value
    assert error.status_for(protocol) == 400 and error.type == "invalid_request_error"
    assert error.param == param and words in error.message
    assert words in json.loads(error.body(protocol))["error"]["message"]


@pytest.mark.parametrize("protocol,choice", [
    (C, {"type": "function", "function": {"name": "nope"}}), (R, {"type": "function", "name": "nope"}),
    (M, {"type": "tool", "name": "nope"})])
def test_a_named_tool_that_is_not_declared_is_refused_by_the_constraint_too(adapter, protocol, choice):
    """The library refuses it first today; the constraint does not rely on that."""
    with pytest.raises(GatewayError) as caught:
        constraint_of(protocol, {"tools": two_tools(protocol), "tool_choice": choice}, plain_parsing(adapter))
    assert caught.value.status == 400 and caught.value.param == "tool_choice" and "'nope'" in caught.value.message


def test_a_chat_json_schema_without_its_body_is_refused_by_the_constraint_too(adapter):
    for fmt, param in (({"type": "json_schema"}, "response_format.json_schema"),
                       ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema")):
        with pytest.raises(GatewayError) as caught:
            constraint_of(C, {"response_format": fmt}, plain_parsing(adapter))
        assert caught.value.status == 400 and caught.value.param == param


def test_every_protocol_has_each_kind_of_case():
    for protocol in Protocol:
        assert any(f[1] is protocol for f in FORMATS) and any(t[1] is protocol for t in TOOL_CALLS)
        assert any(p[1] is protocol for p in PLAIN) and sum(r[1] is protocol for r in REFUSED) >= 4
    assert BODY.keys() == set(Protocol)
