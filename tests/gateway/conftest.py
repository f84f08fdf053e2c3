"""Shared fixtures: one Adapter per test session (tokenizer load ~1 s), SSE helpers, and the running
default (E/P/D) stack that the SDK tests drive."""
from __future__ import annotations

import json

import pytest

from engine.models.v41.tokenizer_file import write_v41_tokenizer
from messages.common import FinishReason
from services.gateway.adapter import Adapter, AdapterConfig, Protocol, ServedModel

MODEL = "deepseek-v4-tiny"
SMALL_MODEL = "deepseek-v4-small-context"
SMALL_CONTEXT = 400
V41_MODEL = "deepseek-v4.1-vision-test"     # V4.1 prompt encoding (keeps images); test-only

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"},
                                                   "days": {"type": "integer"}},
                  "required": ["city"]}


@pytest.fixture(scope="session")
def v41_tokenizer_path(tmp_path_factory) -> str:
    """Our V4.1 tokenizer.json (V4's plus <｜System｜> and <｜deepseek_image｜>)."""
    return str(write_v41_tokenizer(tmp_path_factory.mktemp("v41_tokenizer")))


@pytest.fixture(scope="session")
def adapter(v41_tokenizer_path) -> Adapter:
    return Adapter(AdapterConfig(models=(
        ServedModel(MODEL, context_length=1 << 20),
        ServedModel(SMALL_MODEL, context_length=SMALL_CONTEXT, max_output_tokens=300),
        ServedModel(V41_MODEL, context_length=16384, encoding="v4.1", tokenizer_path=v41_tokenizer_path),
    )))


@pytest.fixture(scope="session")
def tokenizer(adapter):
    return adapter.prepare(Protocol.CHAT, chat_body()).response.tokenizer


def chat_body(**fields) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    body.update(fields)
    return json.dumps(body).encode()


def responses_body(**fields) -> bytes:
    body = {"model": MODEL, "input": "Hi"}
    body.update(fields)
    return json.dumps(body).encode()


def messages_body(**fields) -> bytes:
    body = {"model": MODEL, "max_tokens": 256, "messages": [{"role": "user", "content": "Hi"}]}
    body.update(fields)
    return json.dumps(body).encode()


BODY = {Protocol.CHAT: chat_body, Protocol.RESPONSES: responses_body, Protocol.MESSAGES: messages_body}


def weather_tools(protocol: Protocol) -> list[dict]:
    if protocol is Protocol.CHAT:
        return [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                                  "parameters": WEATHER_SCHEMA}}]
    if protocol is Protocol.RESPONSES:
        return [{"type": "function", "name": "get_weather", "description": "Weather.",
                 "parameters": WEATHER_SCHEMA}]
    return [{"name": "get_weather", "description": "Weather.", "input_schema": WEATHER_SCHEMA}]


def parse_sse(frames: list[bytes]) -> list[tuple[str | None, object]]:
    """SSE frames -> [(event name, decoded data)]; '[DONE]' stays a string."""
    events = []
    for frame in frames:
        text = frame.decode()
        assert text.endswith("\n\n"), text
        name, data = None, None
        for line in text[:-2].split("\n"):
            field, _, value = line.partition(": ")
            if field == "event":
                name = value
            elif field == "data":
                data = value if value == "[DONE]" else json.loads(value)
            else:
                raise AssertionError(f"unexpected SSE line {line!r}")
        events.append((name, data))
    return events


def stream_all(prepared, chunks: list[list[int]], finish=FinishReason.STOP, usage=None,
               response_id="resp-test") -> list[tuple[str | None, object]]:
    stream = prepared.open_stream(response_id)
    frames: list[bytes] = []
    for chunk in chunks:
        frames += stream.push(chunk)
    frames += stream.push([], finish, usage)
    return parse_sse(frames)


def accumulate_all(prepared, chunks: list[list[int]], finish=FinishReason.STOP, usage=None) -> dict:
    acc = prepared.open_accumulator("resp-test")
    for chunk in chunks:
        assert acc.push(chunk) == []
    acc.push([], finish, usage)
    return json.loads(acc.body())


# ---- a running stack (the default E/P/D topology as real processes), shared by this folder's tests ----
@pytest.fixture(scope="session")
def stack(default_stack):
    """The SDK suite runs against the default stack and its default model, V4.1 (tests/conftest.py)."""
    return default_stack
