"""Structured output through the official SDKs on the default stack (real processes, the grammar
compiler included). The model has random weights, so only the constraint makes these outputs JSON:
every response must parse and validate against its schema, in every API that promises it.

The requests of one test run at once (threads), so the engine batches them: constrained rows and a
plain one share steps.
"""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import jsonschema
import openai
import pytest

from tests.grammar.schemas_for_tests import OPTIONAL, SCHEMAS

pytestmark = pytest.mark.slow   # starts service processes

MODEL = "deepseek-v41-tiny"
NO_THINKING = {"thinking": {"type": "disabled"}}   # the constraint starts at once (else after `</think>`)
MAX_TOKENS = 400
NAMES = sorted(SCHEMAS)
# Every schema goes through one API form; together they cover all five. OpenAI's strict mode wants
# every property required, so the schemas with optional ones go through Anthropic's forms.
STRICT_OK = [n for n in NAMES if n not in OPTIONAL]
CHAT_FORMAT, RESPONSES_FORMAT, CHAT_TOOLS = STRICT_OK[0::4], STRICT_OK[1::4], STRICT_OK[2::4]
CLAUDE_TOOLS = STRICT_OK[3::4][:3] + [OPTIONAL[0]]
CLAUDE_FORMAT = STRICT_OK[3::4][3:] + list(OPTIONAL[1:])


@pytest.fixture
def oai(stack):
    return openai.OpenAI(base_url=stack["url"] + "/v1", api_key="unused", max_retries=0, timeout=180)


@pytest.fixture
def claude(stack):
    return anthropic.Anthropic(base_url=stack["url"], api_key="unused", max_retries=0, timeout=180)


def all_at_once(calls):
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def chat_format(oai, name):
    reply = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"Give me a {name} object."}], max_tokens=MAX_TOKENS,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}},
        extra_body=NO_THINKING)
    assert reply.choices[0].finish_reason == "stop", reply
    return reply.choices[0].message.content


def responses_format(oai, name):
    reply = oai.responses.create(
        model=MODEL, input=f"Give me a {name} object.", max_output_tokens=MAX_TOKENS, reasoning={"effort": "none"},
        text={"format": {"type": "json_schema", "name": name, "schema": SCHEMAS[name], "strict": True}})
    assert reply.status == "completed", reply
    return reply.output_text


def chat_tool(oai, name, named: bool):
    tool = {"type": "function", "function": {"name": f"make_{name}", "parameters": SCHEMAS[name], "strict": True}}
    choice = {"type": "function", "function": {"name": f"make_{name}"}} if named else "required"
    reply = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Call the tool."}], max_tokens=MAX_TOKENS,
        tools=[tool], tool_choice=choice, parallel_tool_calls=False, extra_body=NO_THINKING)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls", reply
    assert [c.function.name for c in message.tool_calls] == [f"make_{name}"]
    return message.tool_calls[0].function.arguments


def claude_tool(claude, name, named: bool):
    tool = {"name": f"make_{name}", "input_schema": SCHEMAS[name], "strict": True}
    choice = {"type": "tool", "name": f"make_{name}"} if named else {"type": "any", "disable_parallel_tool_use": True}
    reply = claude.messages.create(model=MODEL, max_tokens=MAX_TOKENS, tools=[tool], tool_choice=choice,
                                   messages=[{"role": "user", "content": "Call the tool."}], thinking={"type": "disabled"})
    uses = [block for block in reply.content if block.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and [u.name for u in uses] == [f"make_{name}"], reply
    return json.dumps(uses[0].input)


def claude_format(claude, name):
    reply = claude.messages.create(model=MODEL, max_tokens=MAX_TOKENS, thinking={"type": "disabled"},
                                   messages=[{"role": "user", "content": f"Give me a {name} object."}],
                                   extra_body={"output_format": {"type": "json_schema", "schema": SCHEMAS[name]}})
    assert reply.stop_reason == "end_turn", reply
    return "".join(block.text for block in reply.content if block.type == "text")


def test_every_constrained_response_validates_in_every_api(oai, claude):
    calls = {**{("chat json_schema", n): (lambda n=n: chat_format(oai, n)) for n in CHAT_FORMAT},
             **{("responses text.format", n): (lambda n=n: responses_format(oai, n)) for n in RESPONSES_FORMAT},
             **{("chat tool", n): (lambda i=i, n=n: chat_tool(oai, n, named=i % 2 == 1))
                for i, n in enumerate(CHAT_TOOLS)},
             **{("claude tool", n): (lambda i=i, n=n: claude_tool(claude, n, named=i % 2 == 1))
                for i, n in enumerate(CLAUDE_TOOLS)},
             **{("claude output_format", n): (lambda n=n: claude_format(claude, n)) for n in CLAUDE_FORMAT}}
    assert len({n for _, n in calls}) >= 20
    texts = all_at_once(list(calls.values()))
    for (api, name), text in zip(calls, texts):
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[name])
        except (ValueError, jsonschema.ValidationError) as exc:
            pytest.fail(f"{api} {name}: {text!r} does not validate: {exc}")


def test_a_plain_request_is_unaffected_by_constrained_neighbours(oai):
    def plain():
        return oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say something."}],
                                           max_tokens=16, temperature=0, extra_body=NO_THINKING).choices[0].message.content
    alone = plain()
    together = all_at_once([plain, *[(lambda n=n: chat_format(oai, n)) for n in NAMES[:4]]])
    assert together[0] == alone


def test_an_unsupported_keyword_is_a_400_naming_it(oai, claude):
    schema = {"type": "object", "properties": {"a": {"type": "string", "not": {"const": "x"}}}, "required": ["a"]}
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, extra_body=NO_THINKING,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert "not" in caught.value.message and caught.value.code == "unsupported_schema_feature"
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hi"}],
                               tools=[{"name": "f", "input_schema": schema, "strict": True}],
                               tool_choice={"type": "any"}, thinking={"type": "disabled"})
    assert caught.value.body["error"]["type"] == "invalid_request_error" and "'not'" in caught.value.message


def test_a_non_strict_schema_ignores_what_it_cannot_enforce(oai):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9,
                                                     "not": {"const": 3}}}, "required": ["a"], "additionalProperties": False}
    reply = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=MAX_TOKENS, extra_body=NO_THINKING,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert 0 <= json.loads(reply.choices[0].message.content)["a"] <= 9


# 8 allOf branches of 4 anyOf alternatives each: 4^8 combinations from 1.3 KB of schema
PATHOLOGICAL = {"type": "object", "allOf": [{"anyOf": [{"properties": {f"k{i}": {"const": j}}} for j in range(4)]}
                                            for i in range(8)]}


def test_a_pathological_schema_is_a_400_within_the_compile_timeout(oai):
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, extra_body=NO_THINKING,
            response_format={"type": "json_schema", "json_schema": {
                "name": "x", "schema": PATHOLOGICAL}})   # not strict: OpenAI's strict rules would refuse it first
    assert caught.value.code == "grammar_too_complex", caught.value
    assert time.monotonic() - started < 10.0 + 5.0   # the default topology's compile_timeout_s, plus slack
