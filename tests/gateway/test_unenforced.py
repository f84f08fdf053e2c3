"""What the deployment cannot serve (images, documents) is a 400 naming it, in each protocol's error
shape. Output constraints (JSON formats, forced and strict tool calls) used to be refused the same
way; now they are enforced: each becomes the request's grammar (test_constraints.py has the details),
except for hand-built requests, which have no body to read the constraint from."""
from __future__ import annotations

import json

import pytest
from deepseek_recipe import Conversation, ConversationRequest, ModelVersion, ToolDefinition, UserMessage

from services.gateway.adapter import GatewayError, Protocol
from tests.gateway.conftest import (
    MODEL, WEATHER_SCHEMA, chat_body, messages_body, responses_body, weather_tools,
)
from tests.gateway.test_bad_inputs import check_shape

C, R, M = Protocol.CHAT, Protocol.RESPONSES, Protocol.MESSAGES
NO_THINKING = {"thinking": {"type": "disabled"}}      # forced tool choices convert only without it
NO_REASONING = {"reasoning": {"effort": "none"}}
JSON_PROMPT = [{"role": "user", "content": "Answer in json."}]
URL = "https://example.com/cat.png"


# OpenAI strict mode (checked by the library) wants every property required and no others
STRICT_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                 "additionalProperties": False}


def strict(protocol: Protocol) -> list[dict]:
    tools = weather_tools(protocol)
    target = tools[0]["function"] if protocol is C else tools[0]
    target["strict"] = True
    target["input_schema" if protocol is M else "parameters"] = STRICT_SCHEMA
    return tools


# (protocol, label, body, param, words the message must contain)
REFUSED = [
    (C, "image_url part", chat_body(messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": URL}}]}]),
     "messages", "image inputs are not supported"),
    (R, "input_image part", responses_body(input=[{"role": "user", "content": [
        {"type": "input_text", "text": "What is it?"}, {"type": "input_image", "image_url": URL}]}]),
     "input", "image inputs are not supported"),
    (M, "image block", messages_body(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": URL}}, {"type": "text", "text": "What is it?"}]}]),
     "messages", "(image at messages[0].content[0])"),
    (M, "image inside a tool result", messages_body(tools=weather_tools(M), messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}]),
     "messages", "(image at messages[2].content[0].content[0])"),
    (C, "file part", chat_body(messages=[{"role": "user", "content": [
        {"type": "text", "text": "Summarise"}, {"type": "file", "file": {"file_id": "f1"}}]}]),
     "messages", "(document at messages[0].content[1])"),
    (R, "input_file part", responses_body(input=[{"role": "user", "content": [
        {"type": "input_file", "file_data": "data:application/pdf;base64,AAAA", "filename": "a.pdf"}]}]),
     "input", "file and document inputs are not supported"),
    (M, "document block", messages_body(messages=[{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}},
        {"type": "text", "text": "Summarise"}]}]),
     "messages", "(document at messages[0].content[0])"),
    (C, "response_format regex", chat_body(response_format={"type": "regex", "regex": "a+"}),
     "response_format", "'regex' is not supported"),
]


@pytest.mark.parametrize("protocol,label,body,param,words", REFUSED, ids=[f"{c[0].name.lower()}-{c[1]}" for c in REFUSED])
def test_what_cannot_be_served_is_a_400_naming_it(adapter, protocol, label, body, param, words):
    with pytest.raises(GatewayError) as caught:
        adapter.prepare(protocol, body)
    check_shape(caught.value, protocol, 400, "invalid_request_error", param)
    assert words in caught.value.message
    assert "not supported" in json.loads(caught.value.body(protocol))["error"]["message"]


def test_every_api_has_image_and_document_refusals():
    for protocol in Protocol:
        labels = " ".join(c[1] for c in REFUSED if c[0] is protocol)
        assert "image" in labels and ("file" in labels or "document" in labels)


# The requests the old deployment refused, now enforced: (protocol, label, body, the constraint's kind)
ENFORCED = [
    (C, "response_format json_object", chat_body(messages=JSON_PROMPT, response_format={"type": "json_object"}),
     "json_object"),
    (C, "response_format json_schema", chat_body(response_format={
        "type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER_SCHEMA}}), "json_schema"),
    (C, "tool_choice required", chat_body(tools=weather_tools(C), tool_choice="required", **NO_THINKING),
     "tool_calls"),
    (C, "tool_choice named", chat_body(tools=weather_tools(C), **NO_THINKING, tool_choice={
        "type": "function", "function": {"name": "get_weather"}}), "tool_calls"),
    (C, "strict function tool", chat_body(tools=strict(C)), "tool_calls"),
    (R, "text.format json_schema", responses_body(text={"format": {
        "type": "json_schema", "name": "w", "schema": WEATHER_SCHEMA}}), "json_schema"),
    (R, "text.format json_object", responses_body(input="Answer in json.", text={"format": {"type": "json_object"}}),
     "json_object"),
    (R, "tool_choice required", responses_body(tools=weather_tools(R), tool_choice="required", **NO_REASONING),
     "tool_calls"),
    (R, "tool_choice named", responses_body(tools=weather_tools(R), **NO_REASONING, tool_choice={
        "type": "function", "name": "get_weather"}), "tool_calls"),
    (R, "strict function tool", responses_body(tools=strict(R)), "tool_calls"),
    (M, "tool_choice any", messages_body(tools=weather_tools(M), tool_choice={"type": "any"}), "tool_calls"),
    (M, "tool_choice tool", messages_body(tools=weather_tools(M), **NO_THINKING, tool_choice={
        "type": "tool", "name": "get_weather"}), "tool_calls"),
    (M, "strict tool", messages_body(tools=strict(M)), "tool_calls"),
    (M, "output_format", messages_body(output_format={"type": "json_schema", "schema": WEATHER_SCHEMA}),
     "json_schema"),
    (M, "output_config.format", messages_body(output_config={"format": {
        "type": "json_schema", "schema": WEATHER_SCHEMA}}), "json_schema"),
]


@pytest.mark.parametrize("protocol,label,body,kind", ENFORCED, ids=[f"{c[0].name.lower()}-{c[1]}" for c in ENFORCED])
def test_output_constraints_are_accepted_and_carried_as_the_requests_grammar(adapter, protocol, label, body, kind):
    prepared = adapter.prepare(protocol, body)
    assert prepared.grammar is not None and json.loads(prepared.grammar.constraint)["kind"] == kind
    assert prepared.generate_request().grammar == prepared.grammar   # what the worker gets


ACCEPTED = [
    (C, chat_body(tools=weather_tools(C), tool_choice="auto")),
    (C, chat_body(tools=weather_tools(C), tool_choice="none")),
    (C, chat_body(response_format={"type": "text"})),
    (C, chat_body(tools=[{**weather_tools(C)[0], "function": {**weather_tools(C)[0]["function"], "strict": False}}])),
    (R, responses_body(tools=weather_tools(R), tool_choice="auto", text={"format": {"type": "text"}})),
    (R, responses_body(tools=weather_tools(R), tool_choice="none")),
    (M, messages_body(tools=weather_tools(M), tool_choice={"type": "auto"})),
    (M, messages_body(tools=weather_tools(M), tool_choice={"type": "none"})),
    (M, messages_body(output_config={"effort": "high"})),
]


@pytest.mark.parametrize("protocol,body", ACCEPTED, ids=[f"{c[0].name.lower()}-{i}" for i, c in enumerate(ACCEPTED)])
def test_optional_tools_and_plain_text_formats_need_no_grammar(adapter, protocol, body):
    assert adapter.prepare(protocol, body).grammar is None


def hand_built(tool_choice: str = "auto", strict_tool: bool = False) -> ConversationRequest:
    tool = ToolDefinition("get_weather", "Weather.", WEATHER_SCHEMA, strict=strict_tool or None)
    return ConversationRequest(Conversation([UserMessage("Hi")], thinking_mode=False, tools=[tool],
                                            tool_choice=tool_choice), ModelVersion.DeepseekV4Pro)


@pytest.mark.parametrize("request_args,words", [
    ({"tool_choice": "required"}, "tool_choice 'required' is not supported"),
    ({"strict_tool": True}, "a strict tool is not supported"),
])
def test_a_hand_built_constrained_request_is_refused_for_want_of_a_body(adapter, request_args, words):
    with pytest.raises(GatewayError) as caught:
        adapter.prepare_conversation(Protocol.CHAT, MODEL, hand_built(**request_args))
    assert caught.value.status == 400 and words in caught.value.message
    assert "only for requests sent as a body" in caught.value.message


def test_a_hand_built_request_with_optional_tools_is_served_without_a_grammar(adapter):
    prepared = adapter.prepare_conversation(Protocol.CHAT, MODEL, hand_built())
    assert prepared.grammar is None and prepared.response.parsing.tool_names == frozenset({"get_weather"})
