"""GatewayError rendering and the mapping of deepseek-recipe exceptions."""
from __future__ import annotations

import json

import pytest
from deepseek_recipe import ChatCompletionRequest, ConversionError, ConversionOptions

from services.gateway.adapter import GatewayError, Protocol, from_library_error
from services.gateway.adapter.errors import internal, invalid_request, overloaded


def test_openai_shape_has_exactly_message_type_param_code():
    error = invalid_request("bad thing", param="messages", code="bad_code")
    for protocol in (Protocol.CHAT, Protocol.RESPONSES):
        assert json.loads(error.body(protocol)) == {"error": {
            "message": "bad thing", "type": "invalid_request_error", "param": "messages",
            "code": "bad_code"}}


def test_anthropic_shape_is_type_error_with_type_and_message():
    assert json.loads(invalid_request("bad thing", param="x").body(Protocol.MESSAGES)) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "bad thing"}}


def test_overloaded_is_529_for_anthropic_and_503_for_openai():
    error = overloaded("busy")
    assert error.status_for(Protocol.MESSAGES) == 529
    assert error.status_for(Protocol.CHAT) == 503
    assert json.loads(error.body(Protocol.MESSAGES))["error"]["type"] == "overloaded_error"
    assert json.loads(error.body(Protocol.CHAT))["error"]["type"] == "server_error"


def test_internal_error_is_api_error_500():
    error = internal("boom")
    assert error.status_for(Protocol.MESSAGES) == 500
    assert json.loads(error.body(Protocol.MESSAGES))["error"]["type"] == "api_error"


def test_unknown_error_type_is_refused():
    with pytest.raises(ValueError):
        GatewayError(400, "teapot_error", "no")


def test_conversion_error_keeps_status_message_and_param():
    with pytest.raises(ConversionError) as caught:
        ChatCompletionRequest(json.dumps({"model": "DeepSeek-V4-Pro", "n": 3, "messages": [
            {"role": "user", "content": "x"}]})).convert(ConversionOptions())
    error = from_library_error(caught.value)
    assert (error.status, error.type) == (caught.value.status_code, "invalid_request_error")
    assert "n = 1" in error.message and error.code is None


def test_bare_value_error_becomes_400_and_anything_else_500():
    assert from_library_error(ValueError("invalid request body: x")).status == 400
    assert from_library_error(KeyError("x")).status == 500
    same = invalid_request("x")
    assert from_library_error(same) is same
