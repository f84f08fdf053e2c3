"""Protocol in: conversion + encoding for Chat Completions, Responses and Messages."""
from __future__ import annotations

import json

import pytest

from messages.generate import GenerateRequest
from services.gateway.adapter import Protocol
from tests.gateway.conftest import (
    BODY, MODEL, SMALL_CONTEXT, SMALL_MODEL, WEATHER_SCHEMA, chat_body, messages_body,
    responses_body, weather_tools,
)

OPEN = "<｜DSML｜tool_calls>"


def prompt_text(prepared) -> str:
    return prepared.response.table.decode(prepared.prompt_ids)


@pytest.mark.parametrize("protocol", list(Protocol))
def test_tools_are_rendered_and_optional_calls_need_no_grammar(adapter, protocol):
    prepared = adapter.prepare(protocol, BODY[protocol](tools=weather_tools(protocol)))
    text = prompt_text(prepared)
    assert '"name": "get_weather"' in text and "## Tools" in text
    assert prepared.grammar is None   # no strict tool: the adapter checks that calls are JSON
    assert prepared.response.parsing.tool_names == frozenset({"get_weather"})
    assert prepared.prompt_ids[0] == 0                       # BOS
    assert text.endswith("<｜Assistant｜><think>")           # thinking by default


@pytest.mark.parametrize("protocol,choice", [
    (Protocol.CHAT, "none"), (Protocol.RESPONSES, "none"), (Protocol.MESSAGES, {"type": "none"})])
def test_tool_choice_none_hides_the_tools_and_turns_off_tool_parsing(adapter, protocol, choice):
    prepared = adapter.prepare(protocol, BODY[protocol](tools=weather_tools(protocol),
                                                        tool_choice=choice))
    assert "get_weather" not in prompt_text(prepared)
    assert prepared.response.parsing.parse_tool_calls is False


def test_tool_choice_required_opens_the_tool_block_in_the_prompt(adapter):
    prepared = adapter.prepare(Protocol.CHAT, chat_body(
        tools=weather_tools(Protocol.CHAT), tool_choice="required", thinking={"type": "disabled"}))
    assert prompt_text(prepared).endswith(f"</think>\n\n{OPEN}\n")
    constraint = json.loads(prepared.grammar.constraint)
    assert (constraint["kind"], constraint["mode"], constraint["opened"]) == ("tool_calls", "required", True)
    assert prepared.response.parsing.starts_in_tool_calls
    assert prepared.response.parsing.library_options().starts_in_tool_calls is False


def test_messages_named_tool_choice_forces_that_call(adapter):
    prepared = adapter.prepare(Protocol.MESSAGES, messages_body(
        tools=weather_tools(Protocol.MESSAGES), tool_choice={"type": "tool", "name": "get_weather"},
        thinking={"type": "disabled"}))
    constraint = json.loads(prepared.grammar.constraint)
    assert (constraint["kind"], constraint["mode"], constraint["name"]) == ("tool_calls", "named", "get_weather")


MULTI_TURN = {
    Protocol.CHAT: dict(messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "RESULT-21C"},
        {"role": "user", "content": "And tomorrow?"}]),
    Protocol.RESPONSES: dict(input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "RESULT-21C"},
        {"role": "user", "content": "And tomorrow?"}]),
    Protocol.MESSAGES: dict(messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                      "content": "RESULT-21C"},
                                     {"type": "text", "text": "And tomorrow?"}]}]),
}


@pytest.mark.parametrize("protocol", list(Protocol))
def test_multi_turn_with_tool_results_renders_call_and_result_in_order(adapter, protocol):
    prepared = adapter.prepare(protocol, BODY[protocol](tools=weather_tools(protocol),
                                                        **MULTI_TURN[protocol]))
    text = prompt_text(prepared)
    call = text.index('<｜DSML｜invoke name="get_weather">')
    assert '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>' in text
    assert call < text.index("RESULT-21C") < text.index("And tomorrow?")


@pytest.mark.parametrize("protocol,field", [(Protocol.CHAT, "stop"),
                                            (Protocol.MESSAGES, "stop_sequences")])
def test_stop_sequences_reach_the_output_parser(adapter, protocol, field):
    prepared = adapter.prepare(protocol, BODY[protocol](**{field: ["END", "\n\n#"]}))
    assert prepared.stop_sequences == ("END", "\n\n#")
    assert prepared.response.parsing.library_options().stop_sequences == ["END", "\n\n#"]


def test_chat_stop_may_be_a_single_string(adapter):
    assert adapter.prepare(Protocol.CHAT, chat_body(stop="END")).stop_sequences == ("END",)


def test_developer_role_renders_exactly_like_system(adapter):
    def ids(role):
        return adapter.prepare(Protocol.CHAT, chat_body(messages=[
            {"role": role, "content": "Answer in French."},
            {"role": "user", "content": "Hi"}])).prompt_ids
    assert ids("developer") == ids("system")
    assert "Answer in French." in prompt_text(adapter.prepare(Protocol.CHAT, chat_body(messages=[
        {"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi"}])))


def test_responses_developer_renders_like_system_and_instructions(adapter):
    def ids(**fields):
        return adapter.prepare(Protocol.RESPONSES, responses_body(**fields)).prompt_ids
    def turns(role):
        return [{"role": role, "content": "Answer in French."}, {"role": "user", "content": "Hi"}]
    system = ids(input=turns("system"))
    assert ids(input=turns("developer")) == system          # 0.2.0 renders it as a user turn
    assert ids(instructions="Answer in French.") == system


def test_sampling_params_are_resolved(adapter):
    prepared = adapter.prepare(Protocol.CHAT, chat_body(
        thinking={"type": "disabled"}, temperature=0.3, top_p=0.5, seed=7, max_tokens=99,
        logprobs=True, top_logprobs=3, stream=True))
    s = prepared.sampling
    assert (s.temperature, s.max_tokens, s.seed, s.logprobs, s.top_logprobs) == (
        pytest.approx(0.3), 99, 7, True, 3)
    assert s.top_p == pytest.approx(0.5) and s.stop_token_ids == [1] and prepared.stream


@pytest.mark.parametrize("protocol", list(Protocol))
def test_thinking_mode_honours_temperature_top_p_and_seed(adapter, protocol):
    prepared = adapter.prepare(protocol, BODY[protocol](temperature=0, top_p=0.5, seed=7))
    assert prompt_text(prepared).endswith("<｜Assistant｜><think>")  # thinking mode, the default
    s = prepared.sampling
    assert (s.temperature, s.top_p, s.seed) == (0.0, 0.5, 7)          # 0.2.0 alone: 1.0, 1.0


def test_thinking_mode_without_sampling_fields_keeps_the_recommended_values(adapter):
    s = adapter.prepare(Protocol.CHAT, chat_body(tools=weather_tools(Protocol.CHAT))).sampling
    assert s.temperature == 1.0 and s.top_p == pytest.approx(0.95) and s.seed is None


def test_messages_top_k_is_passed_to_the_worker(adapter):
    assert adapter.prepare(Protocol.MESSAGES, messages_body(top_k=5)).sampling.top_k == 5


def test_unspecified_max_tokens_fills_the_rest_of_the_context(adapter):
    prepared = adapter.prepare(Protocol.CHAT, chat_body(model=SMALL_MODEL))
    assert len(prepared.prompt_ids) + prepared.sampling.max_tokens == SMALL_CONTEXT
    assert prepared.context_length == SMALL_CONTEXT


def test_requested_max_tokens_is_kept_when_it_fits(adapter):
    prepared = adapter.prepare(Protocol.MESSAGES, messages_body(model=SMALL_MODEL, max_tokens=10))
    assert prepared.sampling.max_tokens == 10


def test_generate_request_carries_prompt_and_sampling(adapter):
    prepared = adapter.prepare(Protocol.RESPONSES, responses_body(max_output_tokens=12))
    request = prepared.generate_request(return_address="tcp://gw:1", arrival_time=1.5)
    assert isinstance(request, GenerateRequest)
    assert request.prompt_ids == prepared.prompt_ids and request.sampling.max_tokens == 12
    assert request.model == MODEL and request.return_address == "tcp://gw:1"


def test_response_format_json_schema_becomes_a_json_constraint(adapter):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    prepared = adapter.prepare(Protocol.CHAT, chat_body(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}))
    assert json.loads(prepared.grammar.constraint) == {"kind": "json_schema", "schema": schema, "strict": False}


def test_model_names_lists_served_models(adapter):
    assert adapter.model_names[:2] == [MODEL, SMALL_MODEL]


def test_weather_schema_is_rendered_verbatim(adapter):
    text = prompt_text(adapter.prepare(Protocol.CHAT, chat_body(tools=weather_tools(Protocol.CHAT))))
    assert json.dumps(WEATHER_SCHEMA) in text
