"""What the deployment cannot enforce yet (output constraints, images, documents) is a 400 naming it, in each
protocol's error shape; tools without forcing and plain text formats stay accepted."""
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


def strict(protocol: Protocol) -> list[dict]:
    tools = weather_tools(protocol)
    target = tools[0]["function"] if protocol is C else tools[0]
    target["strict"] = True
    return tools


# (protocol, label, body, param, words the message must contain)
REFUSED = [
    (C, "response_format json_object", chat_body(messages=JSON_PROMPT, response_format={"type": "json_object"}),
     "response_format", "'json_object' is not supported"),
    (C, "response_format json_schema", chat_body(response_format={
        "type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER_SCHEMA}}),
     "response_format", "'json_schema' is not supported"),
    (C, "response_format regex", chat_body(response_format={"type": "regex", "regex": "a+"}),
     "response_format", "'regex' is not supported"),
    (C, "tool_choice required", chat_body(tools=weather_tools(C), tool_choice="required", **NO_THINKING),
     "tool_choice", "tool_choice 'required' is not supported"),
    (C, "tool_choice named", chat_body(tools=weather_tools(C), **NO_THINKING, tool_choice={
        "type": "function", "function": {"name": "get_weather"}}),
     "tool_choice", "naming the tool 'get_weather' is not supported"),
    (C, "strict function tool", chat_body(tools=strict(C)), "tools[0].function.strict", "strict tools"),
    (C, "image_url part", chat_body(messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": URL}}]}]),
     "messages", "image inputs are not supported"),
    (R, "text.format json_schema", responses_body(text={"format": {
        "type": "json_schema", "name": "w", "schema": WEATHER_SCHEMA}}),
     "text.format", "'json_schema' is not supported"),
    (R, "text.format json_object", responses_body(input="Answer in json.", text={"format": {"type": "json_object"}}),
     "text.format", "'json_object' is not supported"),
    (R, "tool_choice required", responses_body(tools=weather_tools(R), tool_choice="required", **NO_REASONING),
     "tool_choice", "tool_choice 'required' is not supported"),
    (R, "tool_choice named", responses_body(tools=weather_tools(R), **NO_REASONING, tool_choice={
        "type": "function", "name": "get_weather"}),
     "tool_choice", "naming the tool 'get_weather' is not supported"),
    (R, "strict function tool", responses_body(tools=strict(R)), "tools[0].strict", "strict tools"),
    (R, "input_image part", responses_body(input=[{"role": "user", "content": [
        {"type": "input_text", "text": "What is it?"}, {"type": "input_image", "image_url": URL}]}]),
     "input", "image inputs are not supported"),
    (M, "tool_choice any", messages_body(tools=weather_tools(M), tool_choice={"type": "any"}),
     "tool_choice", "tool_choice {type: any} is not supported"),
    (M, "tool_choice tool", messages_body(tools=weather_tools(M), **NO_THINKING, tool_choice={
        "type": "tool", "name": "get_weather"}),
     "tool_choice", "tool_choice {type: tool} is not supported"),
    (M, "strict tool", messages_body(tools=strict(M)), "tools[0].strict", "strict tools"),
    (M, "output_format", messages_body(output_format={"type": "json_schema", "schema": WEATHER_SCHEMA}),
     "output_format", "output_format is not supported"),
    (M, "output_config.format", messages_body(output_config={"format": {
        "type": "json_schema", "schema": WEATHER_SCHEMA}}),
     "output_config.format", "output_config.format is not supported"),
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
]


@pytest.mark.parametrize("protocol,label,body,param,words", REFUSED, ids=[f"{c[0].name.lower()}-{c[1]}" for c in REFUSED])
def test_what_is_not_enforced_is_a_400_naming_it(adapter, protocol, label, body, param, words):
    with pytest.raises(GatewayError) as caught:
        adapter.prepare(protocol, body)
    check_shape(caught.value, protocol, 400, "invalid_request_error", param)
    assert words in caught.value.message
    assert "not supported" in json.loads(caught.value.body(protocol))["error"]["message"]


def test_every_api_has_constraint_and_image_refusals():
    for protocol in Protocol:
        labels = " ".join(c[1] for c in REFUSED if c[0] is protocol)
        assert "tool_choice" in labels and "image" in labels and "strict" in labels
        assert "file" in labels or "document" in labels


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
def test_optional_tools_and_plain_text_formats_stay_accepted(adapter, protocol, body):
    prepared = adapter.prepare(protocol, body)
    assert prepared.constraint is None or prepared.constraint.kind == "tool_call"


def test_a_hand_built_forced_tool_choice_is_refused_too(adapter):
    tool = ToolDefinition("get_weather", "Weather.", WEATHER_SCHEMA)
    request = ConversationRequest(Conversation([UserMessage("Hi")], thinking_mode=False, tools=[tool],
                                               tool_choice="required"), ModelVersion.DeepseekV4Pro)
    with pytest.raises(GatewayError) as caught:
        adapter.prepare_conversation(Protocol.CHAT, MODEL, request)
    assert caught.value.status == 400 and "tool_choice 'required' is not supported" in caught.value.message
