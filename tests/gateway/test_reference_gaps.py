"""Regression tests for the deepseek-recipe 0.2.0 gaps listed in docs/design/v4-reference.md.

Each test first shows the library's own behaviour (the gap, as reproduced in 0.2.0), then the
adapter's. If a later library fixes a gap, only the `reproduces` half needs updating.
"""
from __future__ import annotations

import http.server
import json
import threading

import pytest
from deepseek_recipe import (
    ChatCompletionRequest, ChatCompletionResponse, Conversation, ConversationRequest,
    ConversionError, ConversionOptions, ImageError, InferenceChunk, InferenceFinishReason, MessagesRequest,
    ModelVersion, ReqwestImageFetcher, StreamProcessor, ThinkingInitialStage, ToolDefinition,
    UserMessage,
)

from messages.common import FinishReason
from services.gateway.adapter import Protocol, safe_image_fetcher
from services.gateway.adapter.errors import GatewayError
from services.gateway.adapter.parsing import output_parsing_for
from tests.gateway.conftest import (
    BODY, MODEL, V41_MODEL, WEATHER_SCHEMA, accumulate_all, chat_body, messages_body, stream_all, weather_tools,
)

DSML_CALL = ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="{name}">\n'
             '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
             '<｜DSML｜parameter name="days" string="false">{days}</｜DSML｜parameter>\n'
             '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')


def library_options() -> ConversionOptions:
    return ConversionOptions().with_model_alias(MODEL, ModelVersion.DeepseekV4Pro)


def library_chat_message(adapter, tokenizer, ids: list[int], body: bytes) -> dict:
    """What deepseek-recipe alone makes of these output ids (the gap, reproduced)."""
    converted = ChatCompletionRequest(body).convert(library_options())
    processor = StreamProcessor(ChatCompletionRequest.chunk_generator(converted, "x", MODEL),
                                converted.parsing_options, tokenizer)
    response = ChatCompletionResponse("x", MODEL, 0, 0, 0)
    for chunk in [InferenceChunk.ready(), InferenceChunk.tokens(ids),
                  InferenceChunk.finish(InferenceFinishReason.Stop)]:
        for event in processor.push(chunk):
            response.accumulate(event)
    return json.loads(response.to_json())["choices"][0]["message"]


def adapter_chat_message(adapter, ids: list[int], body: bytes, finish=FinishReason.STOP) -> dict:
    result = accumulate_all(adapter.prepare(Protocol.CHAT, body), [ids], finish)
    return result["choices"][0]


def tool_calls_in(result: dict, protocol: Protocol) -> list[str]:
    if protocol is Protocol.CHAT:
        return [c["function"]["name"] for c in result["choices"][0]["message"].get("tool_calls", [])]
    if protocol is Protocol.RESPONSES:
        return [item["name"] for item in result["output"] if item["type"] == "function_call"]
    return [block["name"] for block in result["content"] if block["type"] == "tool_use"]


# -- protocol in -------------------------------------------------------------------------------

def test_developer_role_is_mapped_to_system(adapter):
    body = chat_body(messages=[{"role": "developer", "content": "Be terse."},
                               {"role": "user", "content": "Hi"}])
    with pytest.raises(ValueError, match="unknown variant `developer`"):    # reproduces
        ChatCompletionRequest(body).convert(library_options())
    assert "Be terse." in adapter.prepare(Protocol.CHAT, body).response.table.decode(
        adapter.prepare(Protocol.CHAT, body).prompt_ids)


def test_shape_errors_are_typed_and_in_each_protocols_own_shape(adapter):
    bad_type = messages_body(messages="not a list")
    with pytest.raises(ValueError) as bare:                                 # reproduces: bare
        MessagesRequest(bad_type)
    assert not isinstance(bare.value, ConversionError)
    bad_value = messages_body(temperature=9)
    with pytest.raises(ConversionError) as shaped:                          # reproduces: OpenAI
        MessagesRequest(bad_value).convert(library_options())  # shape for Messages
    assert "error" in json.loads(shaped.value.body) and "type" not in json.loads(shaped.value.body)
    for body in (bad_type, bad_value):
        with pytest.raises(GatewayError) as ours:
            adapter.prepare(Protocol.MESSAGES, body)
        payload = json.loads(ours.value.body(Protocol.MESSAGES))
        assert ours.value.status_for(Protocol.MESSAGES) == 400
        assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
        assert set(payload["error"]) == {"type", "message"}


# -- protocol out -------------------------------------------------------------------------------

def test_eos_stops_the_output_and_is_never_forwarded(adapter, tokenizer):
    body = chat_body(thinking={"type": "disabled"})
    ids = tokenizer.encode("Hello") + [1] + tokenizer.encode(" junk after eos")
    assert library_chat_message(adapter, tokenizer, ids, body)["content"].startswith(
        "Hello<｜end▁of▁sentence｜>")                                        # reproduces
    stream = adapter.prepare(Protocol.CHAT, body).open_stream()
    frames = stream.push(ids)                                               # no finish reason
    assert stream.finished
    text = b"".join(frames).decode()
    assert "end▁of▁sentence" not in text and "junk" not in text and '"finish_reason":"stop"' in text
    assert adapter_chat_message(adapter, ids, body)["message"]["content"] == "Hello"


def test_push_after_finished_returns_nothing_instead_of_raising(adapter, tokenizer):
    prepared = adapter.prepare(Protocol.CHAT, chat_body())
    processor = StreamProcessor(ChatCompletionRequest.chunk_generator(prepared.response.request,
                                "x", MODEL), prepared.response.parsing.library_options(), tokenizer)
    processor.push(InferenceChunk.ready())
    processor.push(InferenceChunk.finish(InferenceFinishReason.Stop))
    with pytest.raises(RuntimeError):                                       # reproduces
        processor.push(InferenceChunk.text("late"))
    for response in (prepared.open_stream(), prepared.open_accumulator()):
        response.push(tokenizer.encode("ok"), FinishReason.STOP)
        assert response.finished
        assert response.push(tokenizer.encode("late"), FinishReason.STOP) == []
        assert response.push([], FinishReason.LENGTH) == []


def test_unknown_tool_name_becomes_text_not_a_tool_call(adapter, tokenizer):
    body = chat_body(tools=weather_tools(Protocol.CHAT), thinking={"type": "disabled"})
    ids = tokenizer.encode(DSML_CALL.format(name="launch_missiles", days=3))
    assert library_chat_message(adapter, tokenizer, ids, body)["tool_calls"][0]["function"][
        "name"] == "launch_missiles"                                        # reproduces
    choice = adapter_chat_message(adapter, ids, body)
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"
    assert '<｜DSML｜invoke name="launch_missiles">' in choice["message"]["content"]


def test_invalid_json_arguments_become_text_not_a_tool_call(adapter, tokenizer):
    body = chat_body(tools=weather_tools(Protocol.CHAT), thinking={"type": "disabled"})
    ids = tokenizer.encode(DSML_CALL.format(name="get_weather", days="{not json"))
    broken = library_chat_message(adapter, tokenizer, ids, body)["tool_calls"][0]
    with pytest.raises(ValueError):                                         # reproduces
        json.loads(broken["function"]["arguments"])
    choice = adapter_chat_message(adapter, ids, body)
    assert "tool_calls" not in choice["message"]
    assert "{not json" in choice["message"]["content"]


@pytest.mark.parametrize("protocol", list(Protocol))
def test_a_stream_cut_inside_a_tool_call_finishes_without_a_broken_call(adapter, tokenizer, protocol):
    full = DSML_CALL.format(name="get_weather", days="[1, 2, 3]")
    ids = tokenizer.encode(full[:full.index("[1, 2") + 5])                  # cut mid-argument
    body = BODY[protocol](tools=weather_tools(protocol), thinking={"type": "disabled"})
    assert "arguments" in json.dumps(library_chat_message(
        adapter, tokenizer, ids, chat_body(tools=weather_tools(Protocol.CHAT),
                                           thinking={"type": "disabled"})))  # reproduces
    result = accumulate_all(adapter.prepare(protocol, body), [ids], FinishReason.LENGTH)
    assert tool_calls_in(result, protocol) == []
    assert "[1, 2" in json.dumps(result, ensure_ascii=False)               # delivered as text
    events = stream_all(adapter.prepare(protocol, body), [ids], FinishReason.LENGTH)
    assert "call_" not in json.dumps(events)                                # no tool-call event


def test_text_after_a_tool_call_block_is_not_dropped(adapter, tokenizer):
    body = chat_body(tools=weather_tools(Protocol.CHAT), thinking={"type": "disabled"})
    ids = tokenizer.encode("Checking." + DSML_CALL.format(name="get_weather", days=2) +
                           "\nI will report back.")
    assert "report back" not in json.dumps(library_chat_message(adapter, tokenizer, ids, body))
    choice = adapter_chat_message(adapter, ids, body)
    assert choice["message"]["content"] == "Checking.\nI will report back."
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {
        "city": "Paris", "days": 2}
    assert choice["finish_reason"] == "tool_calls"


def test_dsml_marker_inside_reasoning_does_not_truncate_the_answer(adapter, tokenizer):
    body = chat_body(tools=weather_tools(Protocol.CHAT))
    text = "Maybe I should write <｜DSML｜tool_calls> here. No.</think>The answer is 42."
    ids = tokenizer.encode(text)
    lib = library_chat_message(adapter, tokenizer, ids, body)
    assert "42" not in json.dumps(lib)                                      # reproduces
    message = adapter_chat_message(adapter, ids, body)["message"]
    assert message["reasoning_content"] == "Maybe I should write <｜DSML｜tool_calls> here. No."
    assert message["content"] == "The answer is 42." and "tool_calls" not in message


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "5")
        self.end_headers()
        self.wfile.write(b"inner")

    def log_message(self, *args):
        pass


def test_image_fetcher_refuses_loopback_and_private_destinations(adapter):
    server = http.server.HTTPServer(("127.0.0.1", 0), _Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/secret"
    try:
        assert ReqwestImageFetcher().fetch(url) == b"inner"                 # reproduces: SSRF
        for target in (url, f"http://localhost:{server.server_port}/x", "http://10.1.2.3/x",
                       "http://169.254.169.254/latest/meta-data", "http://[::1]/x"):
            with pytest.raises(ImageError) as refused:
                safe_image_fetcher().fetch(target)
            assert refused.value.kind == "DestinationRejected"
    finally:
        server.shutdown()
        server.server_close()
    image_turn = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    v4 = ChatCompletionRequest(chat_body(messages=image_turn)).convert(library_options())
    assert v4.conversation.messages[0].content == "[Unsupported Image]"   # reproduces: silently lost
    for model in (MODEL, V41_MODEL):                                       # refused, never fetched
        with pytest.raises(GatewayError) as refused_input:
            adapter.prepare(Protocol.CHAT, chat_body(model=model, messages=image_turn))
        assert refused_input.value.status == 400 and "image inputs are not supported" in refused_input.value.message


def test_hand_built_conversation_request_gets_a_thinking_stage(adapter, tokenizer):
    request = ConversationRequest(Conversation([UserMessage("Hi")]), ModelVersion.DeepseekV4Pro)
    assert request.parsing_options.thinking_initial_stage is None           # reproduces
    prepared = adapter.prepare_conversation(Protocol.CHAT, MODEL, request)
    assert prepared.response.parsing.thinking_stage == ThinkingInitialStage.ReasoningStart
    message = accumulate_all(prepared, [tokenizer.encode("Let me see.</think>Hello!")])[
        "choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Let me see.", "Hello!")


def test_hand_built_required_tool_choice_starts_inside_the_tool_block(adapter, tokenizer):
    tool = ToolDefinition("get_weather", "Weather.", WEATHER_SCHEMA)
    request = ConversationRequest(Conversation([UserMessage("Hi")], thinking_mode=False,
                                               tools=[tool], tool_choice="required"),
                                  ModelVersion.DeepseekV4Pro)
    assert request.parsing_options.starts_in_tool_calls is False            # reproduces
    assert output_parsing_for(request).starts_in_tool_calls                 # the adapter's parsing repairs it
    # A forced call is enforced by a grammar read from the body: a hand-built request, which has
    # none, is refused rather than served unconstrained; the same request as a body is served.
    with pytest.raises(GatewayError) as refused:
        adapter.prepare_conversation(Protocol.CHAT, MODEL, request)
    assert refused.value.status == 400 and "tool_choice 'required'" in refused.value.message
    prepared = adapter.prepare(Protocol.CHAT, chat_body(tools=weather_tools(Protocol.CHAT), tool_choice="required",
                                                        thinking={"type": "disabled"}))
    assert json.loads(prepared.grammar.constraint)["opened"] is True
    out = DSML_CALL.format(name="get_weather", days=1).split("\n", 1)[1]   # prompt opened block
    message = accumulate_all(prepared, [tokenizer.encode(out)])["choices"][0]["message"]
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
