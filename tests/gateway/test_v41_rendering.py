"""V4.1 through the gateway adapter: prompts (System token, reasoning effort, tools and tool results
in user turns), output parsing (V4.1's spaced DSML tags, EOS), and the encoding picked from the
model directory.

Prompt ids are checked token by token: special tokens by id, plain text as the tokenizer encodes it.
Where vLLM 0.33's V4.1 reference encoder is on disk (/work/refwheels), prompts are also compared
with it, byte for byte.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path

import pytest
from deepseek_recipe import IMAGE_SPECIAL_TOKEN_ID, Tokenizer

from engine.models.v41.tokenizer_file import v4_tokenizer_json, write_v41_tokenizer
from messages.common import FinishReason
from services.gateway.adapter import Adapter, AdapterConfig, Protocol, ServedModel
from services.gateway.model_dir import context_length, served_encoding
from services.gateway.service import GatewayService, GatewaySettings
from services.runtime.config import ServiceConfig
from tests.gateway.conftest import MODEL, V41_MODEL, WEATHER_SCHEMA, parse_sse
from tests.gateway.test_tool_call_splits import normalised, partitions

BOS, EOS, SYSTEM, USER, ASSISTANT, THINK, THINK_END = 0, 1, 128000, 128803, 128804, 128821, 128822
EFFORT = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
VLLM_ENCODER = Path("/work/refwheels/vllm/vllm/tokenizers/deepseek_v41_encoding.py")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                           "parameters": WEATHER_SCHEMA}}]


@pytest.fixture(scope="module")
def v41(adapter):
    """(tokenizer, token table) of the V4.1 model the adapter serves."""
    spec = adapter.prepare(Protocol.CHAT, _chat([{"role": "user", "content": "x"}])).response
    return spec.tokenizer, spec.table


def _chat(messages, model=V41_MODEL, **fields) -> bytes:
    return json.dumps({"model": model, "messages": messages, **fields}).encode()


def _ids(tokenizer, *parts) -> list[int]:
    """Expected prompt ids: ints are special tokens, strings plain text."""
    out: list[int] = []
    for part in parts:
        out += [part] if isinstance(part, int) else tokenizer.encode(part)
    return out


def _text(table, ids) -> str:
    return b"".join(table.token_bytes[i] for i in ids).decode()


def _vllm_reference():
    if not VLLM_ENCODER.exists():
        pytest.skip(f"vLLM's V4.1 reference encoder is not on this machine ({VLLM_ENCODER})")
    spec = importlib.util.spec_from_file_location("vllm_v41_encoding_reference", VLLM_ENCODER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)   # plain Python: json, copy, typing only
    return module


# ---- prompts ------------------------------------------------------------------------------------

def test_system_and_user_with_thinking_on_by_default(adapter, v41):
    tokenizer, table = v41
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = adapter.prepare(Protocol.CHAT, _chat(msgs)).prompt_ids
    assert ids == _ids(tokenizer, BOS, SYSTEM, EFFORT.format(75) + "Be brief.", USER, "Hi", ASSISTANT, THINK)
    assert _text(table, ids) == ("<｜begin▁of▁sentence｜><｜System｜>" + EFFORT.format(75) +
                                 "Be brief.<｜User｜>Hi<｜Assistant｜><think>")


def test_thinking_off_has_no_effort_prefix_and_system_only_with_a_system_message(adapter, v41):
    tokenizer, _ = v41
    off = {"thinking": {"type": "disabled"}}
    plain = adapter.prepare(Protocol.CHAT, _chat([{"role": "user", "content": "Hi"}], **off))
    assert plain.prompt_ids == _ids(tokenizer, BOS, USER, "Hi", ASSISTANT, THINK_END)
    msgs = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]  # -> system
    with_system = adapter.prepare(Protocol.CHAT, _chat(msgs, **off))
    assert with_system.prompt_ids == _ids(tokenizer, BOS, SYSTEM, "Be brief.", USER, "Hi", ASSISTANT, THINK_END)


EFFORTS = {None: 75, "minimal": 50, "low": 50, "medium": 75, "high": 75, "xhigh": 75, "ultra": 100,
           "max": 100, "none": None}     # None: thinking off, no prefix


def _effort_body(protocol: Protocol, effort: str | None) -> bytes:
    if protocol is Protocol.CHAT:
        body = {"messages": [{"role": "user", "content": "Hi"}], **({"reasoning_effort": effort} if effort else {})}
    elif protocol is Protocol.RESPONSES:
        body = {"input": "Hi", **({"reasoning": {"effort": effort}} if effort else {})}
    else:
        body = {"max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}],
                **({"output_config": {"effort": effort}} if effort else {})}
    return json.dumps({"model": V41_MODEL, **body}).encode()


@pytest.mark.parametrize("protocol", list(Protocol))
@pytest.mark.parametrize("effort", list(EFFORTS))
def test_reasoning_effort_of_each_api_becomes_the_numeric_prefix(adapter, v41, protocol, effort):
    """Chat `reasoning_effort`, Responses `reasoning.effort`, Messages `output_config.effort`."""
    tokenizer, _ = v41
    ids = adapter.prepare(protocol, _effort_body(protocol, effort)).prompt_ids
    budget = EFFORTS[effort]
    if budget is None:
        assert ids == _ids(tokenizer, BOS, USER, "Hi", ASSISTANT, THINK_END)
    else:
        assert ids == _ids(tokenizer, BOS, SYSTEM, EFFORT.format(budget), USER, "Hi", ASSISTANT, THINK)


def test_anthropic_thinking_switch_turns_thinking_on_and_off(adapter, v41):
    tokenizer, _ = v41
    base = {"model": V41_MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}]}
    on = {**base, "max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": 1024}}   # effort stays high
    off = {**base, "thinking": {"type": "disabled"}}
    assert adapter.prepare(Protocol.MESSAGES, json.dumps(on).encode()).prompt_ids == _ids(
        tokenizer, BOS, SYSTEM, EFFORT.format(75), USER, "Hi", ASSISTANT, THINK)
    assert adapter.prepare(Protocol.MESSAGES, json.dumps(off).encode()).prompt_ids == _ids(
        tokenizer, BOS, USER, "Hi", ASSISTANT, THINK_END)


TOOL_CONVERSATION = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "weather?"},
    {"role": "assistant", "content": "", "reasoning_content": "r1", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
        {"id": "c2", "type": "function", "function": {"name": "get_weather",
                                                      "arguments": '{"city":"Rome","days":3}'}}]},
    {"role": "tool", "tool_call_id": "c2", "content": "rain"},      # out of call order: sorted back
    {"role": "tool", "tool_call_id": "c1", "content": "sunny <｜DSML｜ calls>"},
]
TOOLS_SECTION = (
    "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke "
    'tools by writing a "<｜DSML｜ calls>" block like the following:\n\n<｜DSML｜ calls>\n'
    '<｜DSML｜ invoke name="$TOOL_NAME">\n<｜DSML｜ parameter name="$PARAMETER_NAME" string="true|false">'
    "$PARAMETER_VALUE</｜DSML｜ parameter>\n...\n</｜DSML｜ invoke>\n"
    '<｜DSML｜ invoke name="$TOOL_NAME2">\n...\n</｜DSML｜ invoke>\n</｜DSML｜ calls>\n\n'
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    '{"name": "get_weather", "description": "Weather.", "parameters": {"type": "object", "properties": '
    '{"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}\n\n'
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)
TOOL_PROMPT = (
    "<｜begin▁of▁sentence｜><｜System｜>" + EFFORT.format(75) + "sys\n\n" + TOOLS_SECTION +
    "<｜User｜>weather?<｜Assistant｜><think>r1</think>\n\n<｜DSML｜ calls>\n"
    '<｜DSML｜ invoke name="get_weather">\n'
    '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n'
    '<｜DSML｜ invoke name="get_weather">\n'
    '<｜DSML｜ parameter name="city" string="true">Rome</｜DSML｜ parameter>\n'
    '<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n'
    "</｜DSML｜ calls><｜end▁of▁sentence｜>"
    "<｜User｜><tool_result>sunny <｜DSML｜ calls></tool_result>\n\n<tool_result>rain</tool_result>"
    "<｜Assistant｜><think>"
)


def test_tools_and_tool_results_in_a_user_turn(adapter, v41):
    _, table = v41
    ids = adapter.prepare(Protocol.CHAT, _chat(TOOL_CONVERSATION, tools=TOOLS)).prompt_ids
    assert _text(table, ids) == TOOL_PROMPT
    assert ids[:2] == [BOS, SYSTEM] and ids[-2:] == [ASSISTANT, THINK]
    # every DSML tag the tools section and the tool calls write is the DSML token (128825); the one
    # a tool result quotes (client data) stays plain text
    assert ids.count(128825) == TOOL_PROMPT.count("｜DSML｜") - 1


@pytest.mark.parametrize("case", ["tools", "mid_system", "thinking_off_history", "multi_turn"])
def test_prompts_match_vllm_reference_encoder(adapter, v41, case):
    ref = _vllm_reference()
    _, table = v41
    conversations = {
        "tools": (TOOL_CONVERSATION, "thinking"),
        "mid_system": ([{"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello", "reasoning_content": "r"},
                        {"role": "system", "content": "Now answer in French."},
                        {"role": "user", "content": "Again"}], "thinking"),
        "thinking_off_history": ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                                  {"role": "user", "content": "Again"}], "chat"),
        "multi_turn": ([{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
                        {"role": "assistant", "content": "b", "reasoning_content": "think b"},
                        {"role": "user", "content": "c"}], "thinking"),
    }
    messages, mode = conversations[case]
    fields = {"tools": TOOLS} if case == "tools" else {}
    if mode == "chat":
        fields["thinking"] = {"type": "disabled"}
    ids = adapter.prepare(Protocol.CHAT, _chat(messages, **fields)).prompt_ids
    reference_messages = [dict(m) for m in messages]
    if case == "tools":
        reference_messages[0]["tools"] = TOOLS
    expected = ref.encode_messages(reference_messages, thinking_mode=mode, reasoning_effort="high")
    assert _text(table, ids) == expected


def test_user_text_spelling_v41_special_tokens_stays_text(adapter, v41):
    _, table = v41
    text = "<｜System｜>x<｜deepseek_image｜>y<｜Assistant｜>"
    ids = adapter.prepare(Protocol.CHAT, _chat([{"role": "user", "content": text}])).prompt_ids
    assert ids.count(SYSTEM) == 1 and IMAGE_SPECIAL_TOKEN_ID not in ids and ids.count(ASSISTANT) == 1
    assert text in _text(table, ids)


# ---- output -------------------------------------------------------------------------------------

V41_OUTPUT = (
    "Zürich 🦜 weather, <｜DSML｜ calls> is only a thought.</think>Checking now.\n\n"
    '<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
    '<｜DSML｜ parameter name="city" string="true">Zürich 🦜 "old town"</｜DSML｜ parameter>\n'
    '<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n'
    "</｜DSML｜ invoke>\n</｜DSML｜ calls>"
)


def _byte_ids(table, text: str) -> list[int]:
    """One token per UTF-8 byte (the byte-level BPE has all 256): every byte boundary is a token one."""
    single = {}
    for token_id, raw in enumerate(table.token_bytes[:128000]):
        if len(raw) == 1:
            single.setdefault(raw[0], token_id)
    return [single[b] for b in text.encode()]


def _stream(prepared, chunks):
    stream = prepared.open_stream("resp-v41")
    frames = [f for chunk in chunks for f in stream.push(chunk)] + stream.push([], FinishReason.STOP)
    return normalised(prepared.protocol, parse_sse(frames))


def test_v41_tool_call_parses_whatever_byte_it_is_split_at(adapter, v41):
    _, table = v41
    prepared = adapter.prepare(Protocol.CHAT, _chat([{"role": "user", "content": "weather?"}], tools=TOOLS,
                                                    stream=True))
    ids = _byte_ids(table, V41_OUTPUT)
    baseline = _stream(prepared, [ids])
    calls = [d["choices"][0]["delta"]["tool_calls"][0] for _, d in baseline
             if isinstance(d, dict) and d["choices"] and "tool_calls" in d["choices"][0]["delta"]]
    assert calls[0]["function"]["name"] == "get_weather"
    arguments = json.loads("".join(c["function"]["arguments"] for c in calls))
    assert arguments == {"city": 'Zürich 🦜 "old town"', "days": 3}
    assert baseline[-2][1]["choices"][0]["finish_reason"] == "tool_calls"
    assert _stream(prepared, [[t] for t in ids]) == baseline, "one byte per push"
    for k in range(1, len(ids)):
        assert _stream(prepared, [ids[:k], ids[k:]]) == baseline, f"split at byte {k}"


@pytest.mark.parametrize("protocol", list(Protocol))
def test_v41_tool_call_in_every_api_and_token_split(adapter, v41, protocol):
    tokenizer, _ = v41
    tools = {Protocol.CHAT: TOOLS,
             Protocol.RESPONSES: [{"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA}],
             Protocol.MESSAGES: [{"name": "get_weather", "input_schema": WEATHER_SCHEMA}]}[protocol]
    body = json.loads(_effort_body(protocol, None))
    prepared = adapter.prepare(protocol, json.dumps({**body, "tools": tools}).encode())
    ids = tokenizer.encode(V41_OUTPUT) + [EOS]
    baseline = _stream(prepared, [ids])
    dumped = json.dumps(baseline, ensure_ascii=False)
    call_marker = {Protocol.CHAT: '"tool_calls"', Protocol.RESPONSES: '"function_call"',
                   Protocol.MESSAGES: '"tool_use"'}[protocol]
    assert call_marker in dumped and "old town" in dumped and "is only a thought" in dumped
    assert "｜DSML｜ invoke" not in dumped          # parsed, not passed on as text
    for label, chunks in partitions(ids):
        assert _stream(prepared, chunks) == baseline, label


def _answer(adapter, tokenizer, output: str, model=V41_MODEL, extra=()):
    spelled = {"tools": TOOLS, "thinking": {"type": "disabled"}}
    prepared = adapter.prepare(Protocol.CHAT, _chat([{"role": "user", "content": "w?"}], model=model, **spelled))
    acc = prepared.open_accumulator("r")
    acc.push(tokenizer.encode(output) + list(extra), FinishReason.STOP)
    return json.loads(acc.body())["choices"][0], acc


def test_each_model_parses_only_its_own_dsml_spelling(adapter, v41):
    tokenizer, _ = v41
    v41_call = V41_OUTPUT.split("</think>")[1]
    v4_call = (v41_call.replace("｜DSML｜ calls", "｜DSML｜tool_calls")
               .replace("｜DSML｜ invoke", "｜DSML｜invoke").replace("｜DSML｜ parameter", "｜DSML｜parameter"))
    choice, _ = _answer(adapter, tokenizer, v41_call)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking now."
    for model, text in ((V41_MODEL, v4_call), (MODEL, v41_call)):    # the other spelling is text
        choice, acc = _answer(adapter, tokenizer, text, model=model)
        assert choice["finish_reason"] == "stop" and not choice["message"].get("tool_calls"), model
        assert choice["message"]["content"] == text and acc.rejected_tool_calls == []


def test_invalid_v41_invoke_reaches_the_client_as_text(adapter, v41):
    tokenizer, _ = v41
    bad = ('<｜DSML｜ calls>\n<｜DSML｜ invoke name="rm_rf">\n'
           '<｜DSML｜ parameter name="x" string="false">{</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>')
    choice, acc = _answer(adapter, tokenizer, "Sure. " + bad + " Done.")
    assert choice["finish_reason"] == "stop" and not choice["message"].get("tool_calls")
    assert bad.split("\n", 1)[1].rsplit("\n", 1)[0] in choice["message"]["content"]
    assert [r.reason for r in acc.rejected_tool_calls] == ["unknown tool 'rm_rf'"]


def test_eos_ends_v41_output_and_is_never_forwarded(adapter, v41):
    tokenizer, _ = v41
    choice, acc = _answer(adapter, tokenizer, "Hello", extra=[EOS] + tokenizer.encode(" more"))
    assert choice["message"]["content"] == "Hello" and choice["finish_reason"] == "stop"
    assert acc.usage.completion == len(tokenizer.encode("Hello")) + 1


# ---- the encoding comes from the model directory ---------------------------------------------------

def _model_dir(tmp_path: Path, config: dict, tokenizer: str | None = "v4.1") -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    if tokenizer == "v4.1":
        write_v41_tokenizer(tmp_path)
    elif tokenizer == "v4":
        (tmp_path / "tokenizer.json").write_bytes(v4_tokenizer_json().read_bytes())
    return tmp_path


V41_CONFIG = {"model_type": "deepseek_v41", "image_token_id": 129264,
              "text_config": {"model_type": "deepseek_v41_text", "max_position_embeddings": 32768}}


def test_encoding_follows_config_json(tmp_path):
    v41 = _model_dir(tmp_path / "a", V41_CONFIG, tokenizer=None)     # only config.json is read
    text_only = _model_dir(tmp_path / "b", {"text_config": {"model_type": "deepseek_v41_text"}}, tokenizer=None)
    v4 = _model_dir(tmp_path / "c", {"model_type": "deepseek_v4", "max_position_embeddings": 4096}, tokenizer=None)
    assert served_encoding(str(v41)) == served_encoding(str(text_only)) == "v4.1"
    assert served_encoding(str(v4)) == "v4" and served_encoding("", "") == "v4"
    assert served_encoding(str(v41), "v4.1") == "v4.1"
    assert context_length(str(v41)) == 32768 and context_length(str(v4)) == 4096
    with pytest.raises(ValueError, match="settings.encoding is 'v4' but .* is a v4.1 model"):
        served_encoding(str(v41), "v4")
    with pytest.raises(ValueError, match="is a v4 model"):
        served_encoding(str(v4), "v4.1")
    with pytest.raises(ValueError, match="encoding must be"):
        GatewaySettings(encoding="v5")


def test_v41_encoding_refuses_a_tokenizer_without_v41_tokens():
    with pytest.raises(ValueError, match="not a V4.1 tokenizer .*<｜System｜>"):
        Adapter(AdapterConfig(models=(ServedModel("m", context_length=64, encoding="v4.1",
                                                  tokenizer_path=str(v4_tokenizer_json())),)))


async def _start(tmp_path: Path, model_dir: Path, **settings) -> tuple[GatewayService, asyncio.Task]:
    svc = GatewayService(ServiceConfig(
        kind="gateway", instance="gw", bind=f"ipc://{tmp_path}/gw.sock", upstream=f"ipc://{tmp_path}/up.sock",
        settings={"http_bind": "127.0.0.1:0", "model_dir": str(model_dir), **settings}))
    task = asyncio.create_task(svc.run(install_signals=False))
    while svc.state == 0 and not task.done():
        await asyncio.sleep(0.01)
    return svc, task


async def test_gateway_serves_v41_from_a_v41_model_dir(tmp_path):
    svc, task = await _start(tmp_path, _model_dir(tmp_path / "model", V41_CONFIG), served_model="m")
    assert not task.done(), "the gateway did not start"
    prepared, _ = svc.prepare(Protocol.CHAT, json.dumps({"model": "m", "messages": [
        {"role": "user", "content": "Hi"}]}).encode())
    assert prepared.prompt_ids[:2] == [BOS, SYSTEM] and prepared.context_length == 32768
    svc.stop()
    assert await task == 0


@pytest.mark.parametrize("case", ["contradicting setting", "V4 tokenizer"])
async def test_gateway_start_fails_when_the_model_dir_disagrees(tmp_path, case):
    if case == "contradicting setting":
        svc, task = await _start(tmp_path, _model_dir(tmp_path / "model", V41_CONFIG), encoding="v4")
    else:
        svc, task = await _start(tmp_path, _model_dir(tmp_path / "model", V41_CONFIG, tokenizer="v4"))
    assert await asyncio.wait_for(task, 30) == 1


def test_written_tokenizer_loads_in_deepseek_recipe(v41_tokenizer_path):
    assert Tokenizer.from_file(v41_tokenizer_path).encode("<｜System｜><｜deepseek_image｜>") == [
        SYSTEM, IMAGE_SPECIAL_TOKEN_ID]
