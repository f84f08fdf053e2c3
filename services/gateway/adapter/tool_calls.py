"""DSML tool-call blocks in model output: split into invokes and validate each one.

V4 writes tool calls as
    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="P" string="true|false">VALUE</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>
V4.1 spells the tags with a space after the DSML token and names the block `calls`:
`<｜DSML｜ calls>`, `<｜DSML｜ invoke name=...>`, `<｜DSML｜ parameter ...>` (vLLM 0.33
`parser/deepseek_v41.py`; deepseek-recipe's V4.1 encoding renders the same). Each model is held to
its own spelling: the other one is a stray marker, i.e. text.

A string="false" value must be JSON. deepseek-recipe 0.2.0 passes unknown names and broken JSON
straight to the client (its parser takes either spelling from either model); the adapter checks
every invoke here first and only lets valid ones become tool calls (see output_scanner.py for what
happens to the others).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DsmlTags:
    """What follows the DSML token in each tag of one model version."""
    block: str
    invoke: str
    parameter: str


V4_TAGS = DsmlTags(block="tool_calls", invoke="invoke", parameter="parameter")
V41_TAGS = DsmlTags(block=" calls", invoke=" invoke", parameter=" parameter")


@dataclass(frozen=True, slots=True)
class BlockItem:
    """One piece of a tool-call block, in order: an invoke, or text that is not one."""
    raw: str                  # the exact text, markers included
    name: str = ""            # the invoked tool ("" for stray text)
    problem: str = ""         # "" only for a valid call of a declared tool


class DsmlSyntax:
    def __init__(self, dsml: str, tags: DsmlTags = V4_TAGS) -> None:
        d = re.escape(dsml)
        invoke, param = re.escape(tags.invoke), re.escape(tags.parameter)
        self.open = f"<{dsml}{tags.block}>"
        self.close = f"</{dsml}{tags.block}>"
        self._invoke = re.compile(f'<{d}{invoke} name="([^"\\n]*)">(.*?)</{d}{invoke}>', re.DOTALL)
        self._param = re.compile(
            f'<{d}{param} name="([^"\\n]*)" string="(true|false)">(.*?)</{d}{param}>', re.DOTALL)

    def split_block(self, body: str, tool_names: frozenset[str], complete: bool) -> list[BlockItem]:
        """Split the text inside one tool-call block (closed, or cut off) into checked items."""
        items: list[BlockItem] = []
        pos = 0
        for m in self._invoke.finditer(body):
            if body[pos:m.start()].strip():
                items.append(BlockItem(body[pos:m.start()], problem="text outside an invoke"))
            items.append(BlockItem(m.group(0), m.group(1), self._problem(m, tool_names)))
            pos = m.end()
        if body[pos:].strip():
            items.append(BlockItem(body[pos:], problem="text outside an invoke" if complete
                                   else "cut off"))
        return items

    def _problem(self, invoke: re.Match, tool_names: frozenset[str]) -> str:
        name, inner = invoke.group(1), invoke.group(2)
        if name not in tool_names:
            return f"unknown tool {name!r}"
        seen: set[str] = set()
        pos = 0
        for p in self._param.finditer(inner):
            if inner[pos:p.start()].strip():
                return "text between parameters"
            pname, is_string, value = p.groups()
            if pname in seen:
                return f"duplicate parameter {pname!r}"
            seen.add(pname)
            if is_string == "false":
                try:
                    json.loads(value)
                except ValueError:
                    return f"parameter {pname!r} is not valid JSON"
            pos = p.end()
        if inner[pos:].strip():
            return "text after the last parameter"
        return ""
