"""Malformed requests across the three APIs: each is a GatewayError with the right status and the
protocol's own error shape (OpenAI `{"error": {...}}`, Anthropic `{"type": "error", ...}`)."""
from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from services.gateway.adapter import GatewayError, Protocol
from tests.gateway.conftest import (
    MODEL, SMALL_MODEL, V41_MODEL, WEATHER_SCHEMA, chat_body, messages_body, responses_body,
)

C, R, M = Protocol.CHAT, Protocol.RESPONSES, Protocol.MESSAGES
LONG = "word " * 600                     # > SMALL_CONTEXT tokens
IMAGE = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]
FN = {"type": "function", "function": {"name": "f", "parameters": WEATHER_SCHEMA}}

# (protocol, label, body, status, error type, param or None for "any")
CASES = [
    *[(p, "invalid json", b'{"model": ', 400, "invalid_request_error", None) for p in Protocol],
    *[(p, "array body", b"[1, 2]", 400, "invalid_request_error", None) for p in Protocol],
    *[(p, "empty body", b"", 400, "invalid_request_error", None) for p in Protocol],
    *[(p, "missing model", json.dumps({"messages": []}).encode(), 400, "invalid_request_error",
       "model") for p in Protocol],
    (C, "model not a string", chat_body(model=5), 400, "invalid_request_error", "model"),
    *[(p, "unknown model", body(model="gpt-5"), 404, "not_found_error", None)
      for p, body in ((C, chat_body), (R, responses_body), (M, messages_body))],
    (C, "prompt longer than context", chat_body(model=SMALL_MODEL, messages=[
        {"role": "user", "content": LONG}]), 400, "invalid_request_error", "messages"),
    (R, "prompt longer than context", responses_body(model=SMALL_MODEL, input=LONG), 400,
     "invalid_request_error", "input"),
    (M, "prompt longer than context", messages_body(model=SMALL_MODEL, messages=[
        {"role": "user", "content": LONG}]), 400, "invalid_request_error", None),
    (C, "prompt + max_tokens > context", chat_body(model=SMALL_MODEL, max_tokens=300, messages=[
        {"role": "user", "content": "word " * 150}]), 400, "invalid_request_error", "max_tokens"),
    (M, "prompt + max_tokens > context", messages_body(model=SMALL_MODEL, max_tokens=300, messages=[
        {"role": "user", "content": "word " * 150}]), 400, "invalid_request_error", None),
    (M, "no max_tokens (required by Anthropic)", json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": "Hi"}]}).encode(), 400, "invalid_request_error", "max_tokens"),
    (M, "max_tokens null", messages_body(max_tokens=None), 400, "invalid_request_error", "max_tokens"),
    (C, "max_tokens above the model bound", chat_body(model=SMALL_MODEL, max_tokens=301), 400,
     "invalid_request_error", None),
    (C, "messages not a list", chat_body(messages="hi"), 400, "invalid_request_error", None),
    (C, "no messages", chat_body(messages=[]), 400, "invalid_request_error", None),
    (C, "unknown role", chat_body(messages=[{"role": "wizard", "content": "x"}]), 400,
     "invalid_request_error", None),
    (C, "content is a number", chat_body(messages=[{"role": "user", "content": 5}]), 400,
     "invalid_request_error", None),
    (C, "temperature wrong type", chat_body(temperature="hot"), 400, "invalid_request_error", None),
    (C, "temperature out of range", chat_body(temperature=5), 400, "invalid_request_error", None),
    (C, "top_p out of range", chat_body(top_p=0), 400, "invalid_request_error", None),
    (C, "n > 1", chat_body(n=2), 400, "invalid_request_error", None),
    (C, "max_tokens zero", chat_body(max_tokens=0), 400, "invalid_request_error", None),
    (C, "max_tokens negative", chat_body(max_tokens=-1), 400, "invalid_request_error", None),
    (C, "top_logprobs too large", chat_body(logprobs=True, top_logprobs=30), 400,
     "invalid_request_error", None),
    (C, "seed negative", chat_body(seed=-5), 400, "invalid_request_error", None),
    (C, "stream not a bool", chat_body(stream="yes"), 400, "invalid_request_error", None),
    (C, "top_k negative", chat_body(top_k=-1), 400, "invalid_request_error", "top_k"),
    (C, "tool name with spaces", chat_body(tools=[{"type": "function", "function": {
        "name": "bad name", "parameters": WEATHER_SCHEMA}}]), 400, "invalid_request_error", None),
    (C, "tool schema not an object", chat_body(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]), 400, "invalid_request_error", None),
    (C, "tool result without a call", chat_body(messages=[
        {"role": "tool", "tool_call_id": "x", "content": "r"}]), 400, "invalid_request_error", None),
    (C, "required tool_choice in thinking mode", chat_body(tools=[FN], tool_choice="required"),
     400, "invalid_request_error", None),
    (C, "image input without vision", chat_body(model=V41_MODEL, messages=IMAGE), 400,
     "invalid_request_error", "messages"),
    (C, "unsupported content part", chat_body(messages=[{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]), 400,
     "invalid_request_error", None),
    (R, "input is a number", responses_body(input=5), 400, "invalid_request_error", None),
    (R, "previous_response_id", responses_body(previous_response_id="resp_1"), 400,
     "invalid_request_error", "previous_response_id"),
    (R, "background", responses_body(background=True), 400, "invalid_request_error", "background"),
    (R, "max_output_tokens zero", responses_body(max_output_tokens=0), 400,
     "invalid_request_error", None),
    (R, "temperature wrong type", responses_body(temperature=[1]), 400, "invalid_request_error", None),
    (R, "seed negative", responses_body(seed=-1), 400, "invalid_request_error", "seed"),
    (R, "no usable input item", responses_body(input=[{"type": "telepathy"}]), 400,
     "invalid_request_error", "input"),
    (R, "unknown role", responses_body(input=[{"role": "wizard", "content": "x"}]), 400,
     "invalid_request_error", None),
    (M, "messages not a list", messages_body(messages="hi"), 400, "invalid_request_error", None),
    (M, "developer role", messages_body(messages=[{"role": "developer", "content": "x"}]), 400,
     "invalid_request_error", None),
    (M, "max_tokens negative", messages_body(max_tokens=-5), 400, "invalid_request_error", None),
    (M, "temperature out of range", messages_body(temperature=3), 400, "invalid_request_error", None),
    (M, "unknown content block", messages_body(messages=[{"role": "user", "content": [
        {"type": "hologram"}]}]), 400, "invalid_request_error", None),
    (M, "system is a number", messages_body(system=7), 400, "invalid_request_error", None),
    (M, "top_k wrong type", messages_body(top_k="many"), 400, "invalid_request_error", "top_k"),
    (M, "seed not an integer", messages_body(seed="many"), 400, "invalid_request_error", "seed"),
]


def check_shape(error: GatewayError, protocol: Protocol, status: int, kind: str, param) -> None:
    assert error.status_for(protocol) == status
    payload = json.loads(error.body(protocol))
    if protocol is Protocol.MESSAGES:
        assert payload == {"type": "error", "error": {"type": kind, "message": error.message}}
    else:
        assert set(payload) == {"error"}
        assert set(payload["error"]) == {"message", "type", "param", "code"}
        assert payload["error"]["type"] == ("invalid_request_error" if status < 500 else
                                            "server_error")
        assert isinstance(payload["error"]["code"], str)
        if param is not None:
            assert payload["error"]["param"] == param
    assert error.type == kind and error.message


@pytest.mark.parametrize("protocol,label,body,status,kind,param", CASES,
                         ids=[f"{c[0].name.lower()}-{c[1]}" for c in CASES])
def test_malformed_request_is_a_typed_error_in_the_protocols_shape(adapter, protocol, label, body,
                                                                  status, kind, param):
    with pytest.raises(GatewayError) as caught:
        adapter.prepare(protocol, body)
    check_shape(caught.value, protocol, status, kind, param)


def test_there_are_at_least_thirty_cases_over_all_three_apis():
    assert len(CASES) >= 30 and {c[0] for c in CASES} == set(Protocol)


@pytest.mark.parametrize("protocol", list(Protocol))
def test_oversized_body_is_413_request_too_large(adapter, protocol):
    small = copy.copy(adapter)
    small.config = dataclasses.replace(adapter.config, max_body_bytes=100)
    with pytest.raises(GatewayError) as caught:
        small.prepare(protocol, chat_body(messages=[{"role": "user", "content": "x" * 200}]))
    check_shape(caught.value, protocol, 413, "request_too_large", None)


def test_unknown_model_names_the_served_models_for_openai(adapter):
    with pytest.raises(GatewayError) as caught:
        adapter.prepare(Protocol.CHAT, chat_body(model="gpt-5"))
    error = json.loads(caught.value.body(Protocol.CHAT))["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model" and MODEL in error["message"]
