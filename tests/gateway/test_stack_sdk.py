"""The default stack served end to end (the E/P/D form: gateway, routers, prefill and decode
workers, KV writer, SWA registry; real processes) driven by the official `openai` and `anthropic` SDKs. The model has random weights, so these assert structure, usage
arithmetic and determinism rather than content."""
from __future__ import annotations

import http.client
import json
from urllib.parse import urlparse

import anthropic
import openai
import pytest

from messages.common import TrafficClass
from ops.control_client import query_status
from tests.helpers.test_helper_kv_records import stored_records
from tests.helpers.test_helper_processes import wait_until

pytestmark = pytest.mark.slow   # starts service processes

MODEL = "deepseek-v41-tiny"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture
def oai(stack):
    return openai.OpenAI(base_url=stack["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def claude(stack):
    return anthropic.Anthropic(base_url=stack["url"], api_key="unused", max_retries=0, timeout=120)


def service(stack, kind):
    return next(s for s in stack["state"]["services"] if s["kind"] == kind)


def worker_status(stack):
    """The decode worker holds a request from its first token to its last."""
    return query_status(service(stack, "decode_worker")["address"], 2.0)


GREEDY = {"temperature": 0}   # this anthropic SDK version has no `temperature` argument
NO_THINKING = {"thinking": {"type": "disabled"}}   # answers in `content`, so texts can be compared


def chat(oai, content="Say something.", **kw):
    return oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                       temperature=0, extra_body=NO_THINKING, **kw)


def test_models_lists_the_served_model(oai, claude):
    assert [m.id for m in oai.models.list()] == [MODEL]
    assert [m.id for m in claude.models.list()] == [MODEL]


def test_chat_non_streaming_structure_usage_and_determinism(oai):
    first = chat(oai, max_tokens=12)
    again = chat(oai, max_tokens=12)
    choice = first.choices[0]
    assert first.object == "chat.completion" and first.model == MODEL
    assert choice.finish_reason in ("stop", "length")
    assert first.usage.prompt_tokens > 0 and first.usage.completion_tokens > 0
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    assert choice.message.content and choice.message.content == again.choices[0].message.content
    assert first.usage == again.usage


def test_temperature_zero_is_greedy_in_thinking_mode_too(oai):
    def think():
        return oai.chat.completions.create(model=MODEL, temperature=0, max_tokens=12,
                                           messages=[{"role": "user", "content": "Think about it."}])
    answers = [think().choices[0].message for _ in range(3)]
    assert len({(m.content, getattr(m, "reasoning_content", None)) for m in answers}) == 1


def test_chat_streaming_equals_non_streaming(oai):
    whole = chat(oai, "Count with me.", max_tokens=10)
    chunks = list(chat(oai, "Count with me.", max_tokens=10, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    streamed = "".join((c.choices[0].delta.content or "") for c in chunks if c.choices)
    assert streamed == (whole.choices[0].message.content or "")
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    usage = [c.usage for c in chunks if c.usage]
    assert usage and usage[-1].completion_tokens == whole.usage.completion_tokens


def test_max_tokens_ends_with_length(oai):
    out = chat(oai, "Tell me a long story.", max_tokens=5)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 5


def test_stop_sequence_cuts_the_greedy_text(oai):
    full = chat(oai, "Write words.", max_tokens=40).choices[0].message.content or ""
    if len(full) < 8:
        pytest.fail(f"greedy text too short to pick a stop sequence from: {full!r}")
    stop = full[len(full) // 2: len(full) // 2 + 3]
    cut = chat(oai, "Write words.", max_tokens=40, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full[: full.index(stop)]


def test_tools_with_tool_choice_and_a_multi_turn_tool_conversation(oai):
    bounded = [{"type": "function", "function": {**TOOLS[0]["function"], "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}]
    named = oai.chat.completions.create(   # enforced by the grammar (test_stack_structured_output.py has more)
        model=MODEL, max_tokens=120, tools=bounded, extra_body=NO_THINKING,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert named.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in named.choices[0].message.tool_calls] == ["get_weather"]
    assert len(json.loads(named.choices[0].message.tool_calls[0].function.arguments)["city"]) <= 8
    forced = oai.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=24, tools=TOOLS, tool_choice="auto", extra_body=NO_THINKING,
        messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert forced.choices[0].finish_reason in ("stop", "length", "tool_calls")
    for call in forced.choices[0].message.tool_calls or []:
        assert call.function.name == "get_weather"
        json.loads(call.function.arguments)
    follow_up = oai.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=8, tools=TOOLS, extra_body=NO_THINKING, messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 21}"},
            {"role": "user", "content": "And tomorrow?"}])
    assert follow_up.usage.prompt_tokens > forced.usage.prompt_tokens
    assert follow_up.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_responses_api_streaming_and_not(oai):
    whole = oai.responses.create(model=MODEL, input="Hello there", max_output_tokens=8, temperature=0,
                                 reasoning={"effort": "none"})
    assert whole.object == "response" and whole.status in ("completed", "incomplete")
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    events = list(oai.responses.create(model=MODEL, input="Hello there", max_output_tokens=8,
                                       temperature=0, reasoning={"effort": "none"}, stream=True))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] in ("response.completed", "response.incomplete")
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed and streamed == whole.output_text


def test_anthropic_messages_streaming_and_not(claude):
    whole = claude.messages.create(model=MODEL, max_tokens=8, extra_body={**GREEDY, **NO_THINKING},
                                   messages=[{"role": "user", "content": "Hi"}])
    assert whole.type == "message" and whole.role == "assistant"
    assert whole.stop_reason in ("end_turn", "max_tokens", "stop_sequence", "tool_use")
    assert whole.usage.input_tokens > 0 and whole.usage.output_tokens > 0
    with claude.messages.stream(model=MODEL, max_tokens=8, extra_body={**GREEDY, **NO_THINKING},
                                messages=[{"role": "user", "content": "Hi"}]) as stream:
        final = stream.get_final_message()
    assert whole.content and whole.content[0].type == "text" and whole.content[0].text
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_anthropic_tools_and_tool_results(claude):
    tools = [{"name": "get_weather", "description": "Weather for a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    bounded = [{**tools[0], "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                                             "required": ["city"]}}]
    forced = claude.messages.create(model=MODEL, max_tokens=120, tools=bounded, extra_body=NO_THINKING,
                                    tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                    messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert forced.stop_reason == "tool_use" and [b.name for b in forced.content if b.type == "tool_use"] == ["get_weather"]
    out = claude.messages.create(model=MODEL, max_tokens=8, tools=tools,
                                 extra_body={**GREEDY, "thinking": {"type": "disabled"}},
                                 tool_choice={"type": "auto"}, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "tu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_1", "content": "21C"}]}])
    assert out.type == "message" and out.usage.input_tokens > 0


def test_errors_come_in_each_protocols_shape(oai, claude):
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.NotFoundError) as err:
        claude.messages.create(model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert err.value.body["type"] == "error"
    with pytest.raises(openai.BadRequestError):
        chat(oai, "x" * 10, max_tokens=10**7)


def test_client_disconnect_mid_stream_frees_the_request_in_the_worker(stack):
    body = {"model": MODEL, "stream": True, "max_tokens": 4000, "temperature": 0,
            "messages": [{"role": "user", "content": "Go on forever."}]}
    url = urlparse(stack["url"])
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    got = [response.readline() for _ in range(6)]
    assert any(line.startswith(b"data: ") for line in got)
    wait_until(lambda: worker_status(stack).load.in_flight >= 1, 10, "the worker to hold the stream")
    conn.sock.close()   # the client goes away mid-stream
    conn.close()
    wait_until(lambda: worker_status(stack).load.in_flight == 0, 20, "the worker to free the aborted request")
    assert worker_status(stack).load.batch_size == 0


def test_gateway_and_worker_agree_on_the_block_hash_chain(oai, stack):
    out = chat(oai, "block " * 400, max_tokens=2)   # > 128 prompt tokens: at least one full block
    assert out.usage.prompt_tokens >= 256
    prefill, gateway = service(stack, "prefill_worker"), service(stack, "gateway")
    log = open(prefill["log"]).read()
    assert '"event": "request.prefilled"' in log   # the worker saw this request ...
    assert '"event": "hash_chain.mismatch"' not in log   # ... and its chain matched the gateway's
    assert '"model_id": "deepseek-v41-tiny-float32-' in open(gateway["log"]).read()


def test_logprobs_and_top_logprobs_come_back_for_every_token(oai):
    out = chat(oai, "Hi", max_tokens=6, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 6
    for token in content:
        assert token.logprob <= 0 and len(token.top_logprobs) == 2
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob
        assert token.logprob <= token.top_logprobs[0].logprob + 1e-6


def test_anthropic_thinking_ends_at_its_budget_and_the_answer_follows(claude):
    ask = dict(model=MODEL, max_tokens=24, messages=[{"role": "user", "content": "Hi"}])
    free = claude.messages.create(**ask, extra_body=GREEDY)   # thinking mode is the default
    bounded = claude.messages.create(**ask, extra_body={**GREEDY, "thinking": {"type": "enabled", "budget_tokens": 4}})
    assert [b.type for b in free.content] == ["thinking"]   # unbounded, this model thinks to the end
    assert bounded.content[0].type == "thinking" and "text" in [b.type for b in bounded.content[1:]]
    thought = bounded.content[0].thinking
    assert thought and free.content[0].thinking.startswith(thought) and len(thought) < len(free.content[0].thinking)


DAY = 86400.0
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                             "parameters": {"type": "object", "properties": {}}}}]


def test_each_traffic_class_gets_its_ttl_in_the_kv_store(oai, stack):
    """Tools make a request agent traffic (kept 3 days); the header overrides that (chatbot: 7 days)."""
    store = str(stack["root"] / ".epd/kvstore")
    before = {r.key for r in stored_records(store)}
    chat(oai, "agent " * 300, max_tokens=2, tools=WEATHER)   # > 2 blocks of prompt: stored by the decode worker
    chat(oai, "chatbot " * 300, max_tokens=2, tools=WEATHER, extra_headers={"x-epd-traffic-class": "chatbot"})

    def ttls():
        return {(r.traffic_class, round((r.expires_at - r.written_at) / DAY, 3))
                for r in stored_records(store) if r.key not in before}
    wait_until(lambda: len(ttls()) == 2, 30, "both requests' blocks in the KV store")
    assert ttls() == {(TrafficClass.AGENT, 3.0), (TrafficClass.CHATBOT, 7.0)}
    assert '"traffic_class": "agent"' in open(service(stack, "gateway")["log"]).read()   # epd trace shows it


def test_an_unknown_traffic_class_is_a_400_naming_the_header(oai):
    with pytest.raises(openai.BadRequestError) as err:
        chat(oai, "Hi", max_tokens=2, extra_headers={"x-epd-traffic-class": "batch"})
    assert err.value.body["param"] == "x-epd-traffic-class"


def test_ready_names_every_pool_of_the_topology(stack):
    """The default topology's pools, each with a live worker once `epd up` returned (/health is liveness)."""
    conn = http.client.HTTPConnection(urlparse(stack["url"]).netloc, timeout=10)
    conn.request("GET", "/ready")
    reply = conn.getresponse()
    body = json.loads(reply.read())
    assert reply.status == 200 and body["not_ready"] == []
    assert body["pools"] == {"prefill": "ready", "decode": "ready", "grammar": "ready", "vision": "ready"}
