"""Protocol out: SSE framing, usage shapes, stop conditions, errors and logprobs."""
from __future__ import annotations

import json

import pytest

from messages.common import FinishReason, Usage
from services.gateway.adapter import GatewayError, Protocol
from tests.gateway.conftest import BODY, accumulate_all, chat_body, parse_sse, stream_all

NO_THINKING = {"thinking": {"type": "disabled"}}


def test_chat_stream_is_data_only_and_ends_with_done(adapter, tokenizer):
    events = stream_all(adapter.prepare(Protocol.CHAT, chat_body(stream=True)),
                        [tokenizer.encode("Hmm.</think>Hello"), tokenizer.encode(" world")])
    assert all(name is None for name, _ in events)
    assert events[-1] == (None, "[DONE]")
    chunks = [data for _, data in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "resp-test" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks)
    assert (reasoning, content) == ("Hmm.", "Hello world")
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("protocol,first,last", [
    (Protocol.RESPONSES, "response.created", "response.completed"),
    (Protocol.MESSAGES, "message_start", "message_stop")])
def test_typed_event_streams_name_every_event_by_its_type(adapter, tokenizer, protocol, first, last):
    events = stream_all(adapter.prepare(protocol, BODY[protocol](stream=True)),
                        [tokenizer.encode("Hmm.</think>Hello")])
    assert [name for name, _ in events] == [data["type"] for _, data in events]
    assert events[0][0] == first and events[-1][0] == last
    if protocol is Protocol.RESPONSES:
        assert [d["sequence_number"] for _, d in events] == list(range(len(events)))


def final_usage(protocol: Protocol, events) -> dict:
    for name, data in reversed(events):
        if protocol is Protocol.CHAT and isinstance(data, dict) and data.get("usage"):
            return data["usage"]
        if name == "response.completed":
            return data["response"]["usage"]
        if name == "message_delta":
            return data["usage"]
    raise AssertionError("no usage")


@pytest.mark.parametrize("protocol", list(Protocol))
def test_usage_reports_worker_counts_cache_hits_and_reasoning_tokens(adapter, tokenizer, protocol):
    prepared = adapter.prepare(protocol, BODY[protocol]())
    prompt = len(prepared.prompt_ids)
    stream = prepared.open_stream("u")
    reasoning = tokenizer.encode("Let me think")                     # 3 reasoning tokens
    frames = stream.push(reasoning, usage=Usage(prompt_tokens=prompt, cached_tokens=64))
    frames += stream.push(tokenizer.encode("</think>Answer."))
    frames += stream.push([1], FinishReason.STOP, Usage(prompt, 64, completion_tokens=9))
    events = parse_sse(frames)
    usage = final_usage(protocol, events)
    if protocol is Protocol.CHAT:
        assert usage["prompt_tokens"] == prompt and usage["completion_tokens"] == 9
        assert usage["prompt_tokens_details"] == {"cached_tokens": 64}
        assert usage["completion_tokens_details"] == {"reasoning_tokens": len(reasoning)}
        assert usage["total_tokens"] == prompt + 9
    elif protocol is Protocol.RESPONSES:
        assert (usage["input_tokens"], usage["output_tokens"]) == (prompt, 9)
        assert usage["input_tokens_details"] == {"cached_tokens": 64}
        assert usage["output_tokens_details"] == {"reasoning_tokens": len(reasoning)}
    else:
        assert (usage["input_tokens"], usage["cache_read_input_tokens"]) == (prompt - 64, 64)
        assert usage["output_tokens"] == 9
        start = events[0][1]["message"]["usage"]
        assert (start["input_tokens"], start["cache_read_input_tokens"]) == (prompt - 64, 64)


@pytest.mark.parametrize("protocol", list(Protocol))
def test_accumulated_body_uses_adapter_usage(adapter, tokenizer, protocol):
    prepared = adapter.prepare(protocol, BODY[protocol](**NO_THINKING))
    cached = len(prepared.prompt_ids) - 1
    body = accumulate_all(prepared, [tokenizer.encode("Hello")], usage=Usage(
        len(prepared.prompt_ids), cached, 2))
    usage = body["usage"]
    assert usage.get("completion_tokens", usage.get("output_tokens")) == 2
    assert cached in (usage.get("prompt_cache_hit_tokens"), usage.get("cache_read_input_tokens"),
                  usage.get("input_tokens_details", {}).get("cached_tokens"))


def test_completion_tokens_fall_back_to_the_adapters_count(adapter, tokenizer):
    prepared = adapter.prepare(Protocol.CHAT, chat_body(**NO_THINKING))
    ids = tokenizer.encode("One two three")
    body = accumulate_all(prepared, [ids + [1]])              # EOS counted, nothing after it
    assert body["usage"]["completion_tokens"] == len(ids) + 1


def test_utf8_split_across_pushes_never_shows_a_replacement_character(adapter, tokenizer):
    prepared = adapter.prepare(Protocol.CHAT, chat_body(**NO_THINKING))
    ids = tokenizer.encode("🦜𝔘")
    assert len(ids) == 6
    stream = prepared.open_stream()
    frames = []
    for token in ids:
        frames += stream.push([token])
    frames += stream.push([], FinishReason.STOP)
    text = "".join(d["choices"][0]["delta"].get("content") or ""
                   for _, d in parse_sse(frames) if isinstance(d, dict))
    assert text == "🦜𝔘"


@pytest.mark.parametrize("protocol,field", [(Protocol.CHAT, "stop"),
                                            (Protocol.MESSAGES, "stop_sequences")])
def test_stop_sequence_finishes_the_response_before_the_worker_does(adapter, tokenizer, protocol,
                                                                    field):
    prepared = adapter.prepare(protocol, BODY[protocol](**NO_THINKING, **{field: ["END"]}))
    stream = prepared.open_stream()
    frames = stream.push(tokenizer.encode("abc EN"))
    assert not stream.finished
    frames += stream.push(tokenizer.encode("D more text"))
    assert stream.finished                                   # the gateway aborts the worker now
    assert stream.push(tokenizer.encode("late"), FinishReason.STOP) == []
    dumped = json.dumps(parse_sse(frames))
    assert "more" not in dumped and "END" not in dumped.replace('"stop_sequence": "END"', "")
    body = accumulate_all(prepared, [tokenizer.encode("abc END more")])
    if protocol is Protocol.CHAT:
        assert body["choices"][0]["message"]["content"] == "abc "
    else:
        assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "END")


@pytest.mark.parametrize("protocol,expected", [
    (Protocol.CHAT, lambda b: b["choices"][0]["finish_reason"] == "length"),
    (Protocol.RESPONSES, lambda b: b["status"] == "incomplete"),
    (Protocol.MESSAGES, lambda b: b["stop_reason"] == "max_tokens")])
def test_length_finish_maps_to_each_protocols_reason(adapter, tokenizer, protocol, expected):
    body = accumulate_all(adapter.prepare(protocol, BODY[protocol]()),
                          [tokenizer.encode("so</think>long")], FinishReason.LENGTH)
    assert expected(body)


@pytest.mark.parametrize("finish,status,kind", [(FinishReason.ERROR, 500, "api_error"),
                                                (FinishReason.ABORT, 503, "overloaded_error")])
@pytest.mark.parametrize("protocol", list(Protocol))
def test_worker_failure_mid_stream_ends_with_a_protocol_error_event(adapter, tokenizer, protocol,
                                                                    finish, status, kind):
    prepared = adapter.prepare(protocol, BODY[protocol]())
    stream = prepared.open_stream()
    stream.push(tokenizer.encode("partial"))
    events = parse_sse(stream.push([], finish))
    assert stream.finished and stream.error is not None and stream.push([1]) == []
    if protocol is Protocol.CHAT:
        assert events[-2][1]["error"]["type"] == "server_error" and events[-1][1] == "[DONE]"
    elif protocol is Protocol.RESPONSES:
        assert events[-1][0] == "error" and events[-1][1]["type"] == "error"
        assert events[-1][1]["sequence_number"] > 0
    else:
        assert events[-1] == ("error", {"type": "error", "error": {
            "type": kind, "message": stream.error.message}})
    accumulator = prepared.open_accumulator()
    accumulator.push(tokenizer.encode("partial"), finish)
    with pytest.raises(GatewayError) as failed:
        accumulator.body()
    expected_status = 529 if (protocol is Protocol.MESSAGES and kind == "overloaded_error") else status
    assert failed.value.status_for(protocol) == expected_status


def test_body_before_the_end_is_an_error(adapter, tokenizer):
    accumulator = adapter.prepare(Protocol.CHAT, chat_body()).open_accumulator()
    accumulator.push(tokenizer.encode("so far"))
    with pytest.raises(GatewayError):
        accumulator.body()


def test_logprobs_are_forwarded_for_plain_tokens(adapter, tokenizer):
    prepared = adapter.prepare(Protocol.CHAT, chat_body(**NO_THINKING, logprobs=True,
                                                        top_logprobs=1))
    ids = tokenizer.encode("Hello world")
    stream = prepared.open_stream()
    frames = stream.push(ids, logprobs=[(-0.25, [(t, -0.25)]) for t in ids])
    frames += stream.push([], FinishReason.STOP)
    entries = [e for _, d in parse_sse(frames) if isinstance(d, dict)
               for e in ((d["choices"][0].get("logprobs") or {}).get("content") or [])]
    assert [e["token"] for e in entries] == ["Hello", " world"]
    assert all(e["logprob"] == -0.25 for e in entries)


def test_marker_spellings_in_a_plain_answer_are_kept_verbatim(adapter, tokenizer):
    text = "Use </think> and ｜DSML｜ literally."
    body = accumulate_all(adapter.prepare(Protocol.CHAT, chat_body(**NO_THINKING)),
                          [tokenizer.encode(text)])
    assert body["choices"][0]["message"]["content"] == text


def test_a_noncharacter_written_by_the_model_cannot_forge_a_marker(adapter, tokenizer):
    body = accumulate_all(adapter.prepare(Protocol.CHAT, chat_body(**NO_THINKING)),
                          [tokenizer.encode("a\ufdd0b")])
    assert body["choices"][0]["message"]["content"] == "a\ufffdb"


@pytest.mark.parametrize("bad_push", [
    lambda s, ids: s.push(ids, logprobs=[(-1.0, [])]),          # fewer logprobs than tokens
    lambda s, ids: s.push(ids, finish=42)])                      # unknown finish reason
def test_malformed_worker_chunks_fail_the_stream_cleanly(adapter, tokenizer, bad_push):
    stream = adapter.prepare(Protocol.CHAT, chat_body()).open_stream()
    events = parse_sse(bad_push(stream, tokenizer.encode("two tokens")))
    assert stream.finished and stream.error.status == 500
    assert "error" in events[-2][1] and events[-1][1] == "[DONE]"
    assert stream.push([5]) == []


def test_prepare_is_safe_to_call_from_many_threads(adapter):
    from concurrent.futures import ThreadPoolExecutor
    bodies = [chat_body(messages=[{"role": "user", "content": f"question {i} " * 50}])
              for i in range(8)]
    serial = [adapter.prepare(Protocol.CHAT, b).prompt_ids for b in bodies]
    with ThreadPoolExecutor(4) as pool:
        parallel = list(pool.map(lambda b: adapter.prepare(Protocol.CHAT, b).prompt_ids, bodies * 3))
    assert parallel == serial * 3
