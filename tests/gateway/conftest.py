"""Shared fixtures: one Adapter per test session (tokenizer load ~1 s), SSE helpers."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from messages.common import FinishReason
from services.gateway.adapter import Adapter, AdapterConfig, Protocol, ServedModel
from tests.conftest import link_model
from tests.helpers.test_helper_processes import REPO
from tests.ops.test_stack_commands import free_port_base, pid_alive

MODEL = "deepseek-v4-tiny"
SMALL_MODEL = "deepseek-v4-small-context"
SMALL_CONTEXT = 400
V41_MODEL = "deepseek-v4.1-vision-test"     # V4.1 prompt encoding (keeps images); test-only

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"},
                                                   "days": {"type": "integer"}},
                  "required": ["city"]}


@pytest.fixture(scope="session")
def adapter() -> Adapter:
    return Adapter(AdapterConfig(models=(
        ServedModel(MODEL, context_length=1 << 20),
        ServedModel(SMALL_MODEL, context_length=SMALL_CONTEXT, max_output_tokens=300),
        ServedModel(V41_MODEL, context_length=16384, encoding="v4.1"),
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


# ---- a running stack (gateway + unified worker as real processes), shared by this folder's tests ----
@pytest.fixture(scope="package")
def stack(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("stack")
    env = {**os.environ, "EPD_RUN_ROOT": str(root / "runs"), "PYTHONPATH": str(REPO)}
    link_model(root, tiny_model_dir)
    base = free_port_base(3)
    http_port = free_port_base(1, offset=0)
    up = subprocess.run([sys.executable, "-m", "ops.cli", "up", "--detach", "--topology", "unified",
                         "--port-base", str(base), "--http-port", str(http_port)],
                        cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr
    state = json.loads((root / "runs/current/state.json").read_text())
    yield {"url": f"http://127.0.0.1:{http_port}", "state": state, "root": root, "env": env}
    subprocess.run([sys.executable, "-m", "ops.cli", "down"], cwd=root, env=env, capture_output=True, timeout=120)
    for pid in [state["supervisor_pid"], *(s["pid"] for s in state["services"])]:
        assert not pid_alive(pid), "epd down left a process behind"


