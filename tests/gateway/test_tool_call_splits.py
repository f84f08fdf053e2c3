"""A scripted model output with reasoning, an answer, a DSML tool call and multi-byte characters
split into byte-level tokens gives the same protocol events however the token stream is chunked.

Events are compared after normalising random tool-call ids and timestamps and merging adjacent
text deltas (how many deltas carry a text depends on chunking; their concatenation and every
other event must not).
"""
from __future__ import annotations

import json
import random
import re

import pytest

from messages.common import FinishReason
from services.gateway.adapter import Protocol
from tests.gateway.conftest import BODY, accumulate_all, parse_sse, weather_tools

MODEL_OUTPUT = (
    "The user wants Zürich 🦜 weather; 𝔘𝔫𝔦 test.</think>Checking 🫠🪿 now.\n\n"
    '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Zürich 🦜 "old town"</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)
_CALL_ID = re.compile(r"call_\d+_[A-Za-z0-9]+")
_VOLATILE = {"created", "created_at", "completed_at"}
_MERGEABLE = {"response.output_text.delta", "response.reasoning_text.delta",
              "response.function_call_arguments.delta"}


def _scrub(value):
    if isinstance(value, dict):
        return {k: 0 if k in _VOLATILE else _scrub(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    if isinstance(value, str):
        return _CALL_ID.sub("call_ID", value)
    return value


def _merge_key(protocol: Protocol, name, data):
    """Key under which adjacent events are pure text deltas of the same thing, else None."""
    if protocol is Protocol.CHAT and isinstance(data, dict) and data["choices"]:
        choice = data["choices"][0]
        delta = choice["delta"]
        if choice["finish_reason"] is None and "role" not in delta:
            if "tool_calls" in delta and "id" not in delta["tool_calls"][0]:
                return ("args", delta["tool_calls"][0]["index"])
            texts = [k for k in ("content", "reasoning_content") if delta.get(k)]
            if len(texts) == 1 and "tool_calls" not in delta:
                return ("text", texts[0])
    if protocol is Protocol.RESPONSES and name in _MERGEABLE:
        return (name, data["item_id"])
    if protocol is Protocol.MESSAGES and name == "content_block_delta":
        if data["delta"]["type"] != "signature_delta":
            return (data["index"], data["delta"]["type"])
    return None


def _append(protocol: Protocol, into: dict, data: dict) -> None:
    if protocol is Protocol.CHAT:
        d_into, d_new = into["choices"][0]["delta"], data["choices"][0]["delta"]
        if "tool_calls" in d_new:
            d_into["tool_calls"][0]["function"]["arguments"] += d_new["tool_calls"][0]["function"][
                "arguments"]
        else:
            for key in ("content", "reasoning_content"):
                if d_new.get(key):
                    d_into[key] += d_new[key]
    elif protocol is Protocol.RESPONSES:
        into["delta"] += data["delta"]
    else:
        field = {"text_delta": "text", "thinking_delta": "thinking",
                 "input_json_delta": "partial_json"}[data["delta"]["type"]]
        into["delta"][field] += data["delta"][field]


def normalised(protocol: Protocol, events) -> list:
    out: list = []
    last_key = None
    for name, data in events:
        data = _scrub(data)
        key = _merge_key(protocol, name, data)
        if key is not None and key == last_key:
            _append(protocol, out[-1][1], data)
            continue
        out.append((name, data))
        last_key = key
    if protocol is Protocol.RESPONSES:
        for number, (_, data) in enumerate(out):
            if isinstance(data, dict) and "sequence_number" in data:
                data["sequence_number"] = number
    return out


def run(prepared, chunks: list[list[int]]) -> list:
    stream = prepared.open_stream("resp-split")
    frames: list[bytes] = []
    for chunk in chunks:
        frames += stream.push(chunk)
    frames += stream.push([], FinishReason.STOP)
    return normalised(prepared.protocol, parse_sse(frames))


def partitions(ids: list[int]):
    yield "singletons", [[t] for t in ids]
    for k in range(1, len(ids)):
        yield f"split@{k}", [ids[:k], ids[k:]]
    rng = random.Random(7)
    for n in range(10):
        cuts = sorted(rng.sample(range(1, len(ids)), rng.randint(2, 12)))
        yield f"random{n}", [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)])]


@pytest.mark.parametrize("protocol", list(Protocol))
def test_tool_call_events_do_not_depend_on_chunking(adapter, tokenizer, protocol):
    prepared = adapter.prepare(protocol, BODY[protocol](tools=weather_tools(protocol)))
    ids = tokenizer.encode(MODEL_OUTPUT) + [1]               # EOS ends it
    baseline = run(prepared, [ids])
    dumped = json.dumps(baseline, ensure_ascii=False)
    assert "get_weather" in dumped and "Zürich 🦜" in dumped and "𝔘𝔫𝔦" in dumped
    assert "\ufffd" not in dumped                              # no UTF-8 sequence was torn
    for label, chunks in partitions(ids):
        assert run(prepared, chunks) == baseline, label


@pytest.mark.parametrize("protocol", list(Protocol))
def test_accumulated_body_does_not_depend_on_chunking(adapter, tokenizer, protocol):
    prepared = adapter.prepare(protocol, BODY[protocol](tools=weather_tools(protocol)))
    ids = tokenizer.encode(MODEL_OUTPUT)
    baseline = _scrub(accumulate_all(prepared, [ids]))
    for label, chunks in partitions(ids):
        assert _scrub(accumulate_all(prepared, chunks)) == baseline, label
    arguments = json.dumps(baseline, ensure_ascii=False)
    assert "old town" in arguments


def test_split_tool_call_arguments_are_exact_json(adapter, tokenizer):
    prepared = adapter.prepare(Protocol.CHAT, BODY[Protocol.CHAT](tools=weather_tools(Protocol.CHAT)))
    ids = tokenizer.encode(MODEL_OUTPUT)
    message = accumulate_all(prepared, [[t] for t in ids])["choices"][0]["message"]
    assert message["reasoning_content"] == "The user wants Zürich 🦜 weather; 𝔘𝔫𝔦 test."
    assert message["content"] == "Checking 🫠🪿 now."
    call = message["tool_calls"][0]["function"]
    assert json.loads(call["arguments"]) == {"city": 'Zürich 🦜 "old town"', "days": 3}
