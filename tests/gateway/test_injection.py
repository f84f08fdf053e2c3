"""Special-token injection: text that spells special tokens must encode as plain text.

The reference is independent of the library's encoder: render the prompt, find the spans where
the client's text was placed (each placement carries its own tag), split the template parts at
every added-token spelling, and encode each plain segment with a `tokenizers.Tokenizer` built from
the same tokenizer.json with its added vocabulary removed.

One deliberate exception in deepseek-recipe, encoded in the reference: inside *assistant* text
(answer and replayed reasoning) the eight grounding tokens (<｜ref｜>, <｜box｜>, <｜point｜>,
<｜polygon｜> and their closers) are encoded as the special tokens the model emitted, so replayed
history re-encodes to the generated ids. They delimit nothing (no role, turn, reasoning or
tool-call boundary), so they cannot be used to forge structure.
"""
from __future__ import annotations

import json
import re

import pytest
from deepseek_recipe import DeepseekV4Encoding
from tokenizers import Tokenizer as HfTokenizer

from services.gateway.adapter import Protocol, packaged_v4_tokenizer
from tests.gateway.conftest import BODY, WEATHER_SCHEMA

GROUNDING = [f"<｜{close}{kind}｜>" for kind in ("ref", "box", "point", "polygon")
             for close in ("", "/")]


@pytest.fixture(scope="module")
def vocab():
    with open(packaged_v4_tokenizer(), encoding="utf-8") as f:
        spec = json.load(f)
    added = {t["content"]: t["id"] for t in spec["added_tokens"]}
    spec["added_tokens"] = []
    plain = HfTokenizer.from_str(json.dumps(spec))
    return added, plain


@pytest.fixture(scope="module")
def core(vocab):
    added, _ = vocab
    spellings = sorted(added, key=lambda s: added[s])
    return "".join(spellings) + " | " + " ".join(spellings) + " end"


def placements(protocol: Protocol, core: str) -> tuple[dict, list[str], set[str]]:
    """(request fields, tags of every placement, tags that are assistant content)."""
    def p(tag):
        return f"[{tag}] {core}"
    args = json.dumps({"city": p("args")}, ensure_ascii=False)
    if protocol is Protocol.CHAT:
        fields = dict(
            tools=[{"type": "function", "function": {"name": "get_weather",
                                                     "description": p("tooldesc"),
                                                     "parameters": WEATHER_SCHEMA}}],
            messages=[{"role": "system", "content": p("system")},
                      {"role": "developer", "content": p("developer")},
                      {"role": "user", "content": p("user")},
                      {"role": "assistant", "content": p("assistant"),
                       "reasoning_content": p("reasoning"), "tool_calls": [{
                          "id": "c1", "type": "function",
                          "function": {"name": "get_weather", "arguments": args}}]},
                      {"role": "tool", "tool_call_id": "c1", "content": p("tool")},
                      {"role": "user", "content": p("user2")}])
        tags = ["system", "developer", "tooldesc", "user", "reasoning", "assistant", "args", "tool",
                "user2"]
    elif protocol is Protocol.RESPONSES:
        fields = dict(
            instructions=p("system"),
            tools=[{"type": "function", "name": "get_weather", "description": p("tooldesc"),
                    "parameters": WEATHER_SCHEMA}],
            input=[{"role": "user", "content": p("user")},
                   {"role": "assistant", "content": p("assistant")},
                   {"type": "function_call", "call_id": "c1", "name": "get_weather",
                    "arguments": args},
                   {"type": "function_call_output", "call_id": "c1", "output": p("tool")},
                   {"role": "user", "content": p("user2")}])
        tags = ["system", "tooldesc", "user", "assistant", "args", "tool", "user2"]
    else:
        fields = dict(
            system=p("system"),
            tools=[{"name": "get_weather", "description": p("tooldesc"),
                    "input_schema": WEATHER_SCHEMA}],
            messages=[{"role": "user", "content": p("user")},
                      {"role": "assistant", "content": [
                          {"type": "text", "text": p("assistant")},
                          {"type": "tool_use", "id": "c1", "name": "get_weather",
                           "input": {"city": p("args")}}]},
                      {"role": "user", "content": [
                          {"type": "tool_result", "tool_use_id": "c1", "content": p("tool")},
                          {"type": "text", "text": p("user2")}]}])
        tags = ["system", "tooldesc", "user", "assistant", "args", "tool", "user2"]
    return fields, tags, {"assistant", "reasoning"}


def regions(prompt: str, core: str, tags: list[str], assistant: set[str]):
    """[(start, end, kind)] covering the prompt; kind: 'template', 'assistant' or 'client'."""
    spans = []
    for tag in tags:
        found = [m.start() for m in re.finditer(re.escape(f"[{tag}] {core}"), prompt)]
        assert len(found) == 1, f"{tag}: expected one verbatim placement, found {len(found)}"
        spans.append((found[0], found[0] + len(f"[{tag}] {core}"),
                      "assistant" if tag in assistant else "client"))
    spans.sort()
    out, pos = [], 0
    for start, end, kind in spans:
        out += [(pos, start, "template"), (start, end, kind)]
        pos = end
    return out + [(pos, len(prompt), "template")]


def reference_ids(prompt: str, layout, added: dict[str, int], plain: HfTokenizer) -> list[int]:
    def alternation(spellings):
        return re.compile("|".join(re.escape(s) for s in sorted(spellings, key=len, reverse=True)))
    specials = {"template": alternation(added), "assistant": alternation(GROUNDING), "client": None}
    ids: list[int] = []
    segment_start = 0
    for start, end, kind in layout:
        if specials[kind] is None:
            continue
        for m in specials[kind].finditer(prompt, start, end):
            if m.start() > segment_start:
                ids += plain.encode(prompt[segment_start:m.start()], add_special_tokens=False).ids
            ids.append(added[m.group(0)])
            segment_start = m.end()
    if segment_start < len(prompt):
        ids += plain.encode(prompt[segment_start:], add_special_tokens=False).ids
    return ids


@pytest.mark.parametrize("protocol", list(Protocol))
def test_special_token_spellings_in_client_text_encode_as_plain_text(adapter, vocab, core,
                                                                     protocol):
    added, plain = vocab
    fields, tags, assistant = placements(protocol, core)
    prepared = adapter.prepare(protocol, BODY[protocol](**fields))
    prompt = DeepseekV4Encoding().render_conversation(prepared.response.request.conversation).prompt
    layout = regions(prompt, core, tags, assistant)
    expected = reference_ids(prompt, layout, added, plain)
    assert prepared.prompt_ids == expected
    special_ids = set(added.values())
    assert sum(t in special_ids for t in prepared.prompt_ids) < 80   # template + grounding only


def test_a_naive_full_vocabulary_encode_would_inject(vocab, core, tokenizer):
    added, plain = vocab
    special_ids = set(added.values())
    assert sum(t in special_ids for t in tokenizer.encode(core)) >= len(added)
    assert not any(t in special_ids for t in plain.encode(core, add_special_tokens=False).ids)
