"""The requests of `epd bench gateway`: an agentic coding conversation sized to a token budget
(system prompt, three tools, read_file calls returning Python standard-library source, a follow-up),
the streaming request of each protocol, and the visible text of a protocol's SSE frames."""
from __future__ import annotations

import importlib.util
import json

MODEL = "bench-v4"
SOURCE_MODULES = ("argparse", "difflib", "inspect", "typing", "enum", "dataclasses", "functools",
                  "asyncio.base_events", "pathlib", "textwrap")
SYSTEM = ("You are a senior Python engineer working in the user's repository. Read files with read_file, "
          "search with search_code and run the tests with run_tests before answering. Keep answers short, "
          "show unified diffs, and say why each change is needed. Reply in the user's language.")
ASK = ("Our CLI rejects `--seconds 0.5` with 'invalid float value' on some machines, and the help text "
       "wraps badly in narrow terminals. Can you read the parser code and find out why? "
       "顺便看看帮助文本的换行问题，谢谢！")
FOLLOW_UP = ("Thanks. Based on the files above, write the smallest patch that fixes both problems and "
             "a regression test for each. Explain any behaviour change for existing users.")
REASONING = ("The user says the float option fails only on some machines, so locale is the first suspect. "
             "argparse calls the type callable on the raw string; float() is locale-independent, though, "
             "so the difference must come from how the value reaches the parser. 也可能是参数前缀的问题。 "
             "Negative-number detection and prefix matching are the next places to look. ")
ANSWER = ("The failure is not about floats at all: `--seconds` is matched as an abbreviation of "
          "`--seconds-per-cell` when `allow_abbrev` is on, so the value goes to the wrong option. 🙂\n\n"
          "Here is how `textwrap` fills the help text, which explains the wrapping:\n\n```python\n")
TOOLS = (("read_file", "Read a file of the repository.", {"path": {"type": "string"}}),
         ("search_code", "Search the repository.", {"query": {"type": "string"}, "glob": {"type": "string"}}),
         ("run_tests", "Run pytest on a target.", {"target": {"type": "string"}, "verbose": {"type": "boolean"}}))


def kind_of(protocol) -> str:
    return protocol.name.lower()   # chat | responses | messages




class SourceLines:
    """Python standard-library source, line by line (cycled), with each line's token count."""

    def __init__(self, tokenizer, modules: tuple[str, ...] = SOURCE_MODULES) -> None:
        self.tokenizer = tokenizer
        self.lines: list[tuple[str, str]] = []
        for module in modules:
            with open(importlib.util.find_spec(module).origin, encoding="utf-8") as f:
                self.lines += [(f"lib/{module.replace('.', '/')}.py", line) for line in f.read().splitlines(True)]
        self.costs: dict[int, int] = {}

    def read(self, start: int, budget: int) -> tuple[str, str, int]:
        """(path of the first line, about `budget` tokens of text, next line) from line `start` on."""
        text, used, i = [], 0, start
        while used < budget:
            line = i % len(self.lines)
            if line not in self.costs:
                self.costs[line] = len(self.tokenizer.encode(self.lines[line][1]))
            text.append(self.lines[line][1])
            used += self.costs[line]
            i += 1
        return self.lines[start % len(self.lines)][0], "".join(text), i


def chat_body(files: list[tuple[str, str]]) -> bytes:
    """System prompt, tools, the ask, one read_file call + result per file, a follow-up; streaming."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]
    for i, (path, text) in enumerate(files):
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "read_file", "arguments": json.dumps({"path": path})}}
        messages += [{"role": "assistant", "content": "", "reasoning_content": f"I should read {path} first.",
                      "tool_calls": [call]}, {"role": "tool", "tool_call_id": f"call_{i}", "content": text}]
    messages.append({"role": "user", "content": FOLLOW_UP})
    return json.dumps({"model": MODEL, "stream": True, "max_tokens": 4096, "temperature": 0.6,
                       "tools": _tools("chat"), "messages": messages}, ensure_ascii=False).encode()


def stream_body(protocol) -> bytes:
    kind = kind_of(protocol)
    body = {"model": MODEL, "stream": True, "tools": _tools(kind)}
    if kind == "chat":
        body.update(max_tokens=4096, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}])
    elif kind == "responses":
        body.update(max_output_tokens=4096, instructions=SYSTEM, input=ASK)
    else:
        body.update(max_tokens=4096, system=SYSTEM, messages=[{"role": "user", "content": ASK}])
    return json.dumps(body, ensure_ascii=False).encode()


def _tools(kind: str) -> list[dict]:
    tools = [{"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": [next(iter(properties))]}}
        for name, description, properties in TOOLS]
    if kind == "chat":
        return [{"type": "function", "function": tool} for tool in tools]
    if kind == "responses":
        return [{"type": "function", **tool} for tool in tools]
    return [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in tools]


def library_classes(protocol) -> tuple[type, type]:
    import deepseek_recipe as lib
    return {"chat": (lib.ChatCompletionRequest, lib.ChatCompletionResponse),
            "responses": (lib.ResponsesRequest, lib.ResponsesResponse),
            "messages": (lib.MessagesRequest, lib.MessagesResponse)}[kind_of(protocol)]


def visible_text(frames: list[bytes]) -> tuple[str, str]:
    """(reasoning, answer) as a client of any of the three protocols shows them."""
    reasoning, answer = [], []
    for frame in frames:
        data = frame.decode().rpartition("data: ")[2].strip()
        event = json.loads(data) if data.startswith("{") else {}
        for choice in event.get("choices") or ():
            reasoning.append(choice["delta"].get("reasoning_content") or "")
            answer.append(choice["delta"].get("content") or "")
        kind, delta = event.get("type"), event.get("delta")
        if kind in ("response.reasoning_text.delta", "response.output_text.delta"):
            (reasoning if "reasoning" in kind else answer).append(delta)
        elif kind == "content_block_delta":
            reasoning.append(delta.get("thinking", ""))
            answer.append(delta.get("text", ""))
    return "".join(reasoning), "".join(answer)
