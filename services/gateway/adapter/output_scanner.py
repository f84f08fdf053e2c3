"""The text filter between the detokenizer and deepseek-recipe's stream parser.

deepseek-recipe 0.2.0's parser, fed raw model text, (a) ends the answer at a DSML marker written
inside reasoning, (b) drops all text after a tool-call block, (c) turns any DSML invoke into a tool
call (unknown names, broken JSON included), (d) silently drops `</think>` inside the answer. This
scanner tracks where the model is (reasoning / answer / tool-call block) and hands the parser text
it cannot misread:

- Marker spellings that are *text* (a DSML marker in reasoning, a stray DSML marker or `</think>`
  in the answer) are replaced by one private sentinel character each; `restore()` puts the real
  spelling back into the protocol JSON the parser produces. Sentinel characters the model itself
  writes become U+FFFD, so restoring is exact.
- A tool-call block is held until it closes. Each invoke is checked (declared tool name, JSON for
  every string="false" parameter, nothing but parameters inside). Valid invokes are kept and given
  to the parser as ONE block when the stream finishes, so text the model writes after a block still
  reaches the client (it arrives before the tool calls: every protocol puts tool calls last).
  Invalid invokes, stray text inside a block and an unfinished block of a cut stream are delivered
  as answer text, verbatim: nothing is dropped and no broken tool call reaches a client.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from services.gateway.adapter.tool_calls import V4_TAGS, DsmlSyntax, DsmlTags

SENTINEL_DSML = "\ufdd0"     # Unicode noncharacters: never meaningful text
SENTINEL_THINK_END = "\ufdd1"


class Stage(Enum):
    REASONING = 1
    ANSWER = 2
    TOOL_BLOCK = 3


@dataclass(frozen=True, slots=True)
class Rejected:
    text: str
    reason: str


class OutputScanner:
    def __init__(self, *, start: Stage, parse_tool_calls: bool, tool_names: frozenset[str],
                 dsml: str, think_end: str, tags: DsmlTags = V4_TAGS) -> None:
        self.stage = start
        self.rejected: list[Rejected] = []          # invokes turned into text, for logs/metrics
        self._parse_tool_calls = parse_tool_calls
        self._tool_names = tool_names
        self._syntax = DsmlSyntax(dsml, tags)       # the model version's tag spelling
        self._dsml, self._think_end = dsml, think_end
        self._held = ""
        self._block = ""
        self._calls: list[str] = []
        answer_markers = [dsml, think_end] + ([self._syntax.open] if parse_tool_calls else [])
        self._answer_marker = re.compile("|".join(re.escape(m) for m in sorted(
            answer_markers, key=len, reverse=True)))
        self._prefixes = {
            Stage.REASONING: _proper_prefixes([dsml, think_end]),
            Stage.ANSWER: _proper_prefixes(answer_markers)}
        self._restore = {SENTINEL_DSML: dsml, SENTINEL_THINK_END: think_end}

    @property
    def has_held_text(self) -> bool:
        """True while text that may start a marker is kept back."""
        return bool(self._held)

    def feed(self, text: str) -> str:
        """Take decoded model text; return the text the stream parser should get now."""
        if SENTINEL_DSML in text or SENTINEL_THINK_END in text:
            text = text.replace(SENTINEL_DSML, "\ufffd").replace(SENTINEL_THINK_END, "\ufffd")
        buf, self._held = self._held + text, ""
        out: list[str] = []
        while buf:
            if self.stage is Stage.REASONING:
                buf = self._reasoning(buf, out)
            elif self.stage is Stage.ANSWER:
                buf = self._answer(buf, out)
            else:
                buf = self._tool_block(buf, out)
        return "".join(out)

    def finish(self) -> str:
        """The stream ended: release everything held, then the valid tool calls as one block."""
        out = [self._escape(self._held)] if self._held else []
        self._held = ""
        if self.stage is Stage.TOOL_BLOCK:
            out.append(self._settle(self._block, complete=False))
            self._block = ""
            self.stage = Stage.ANSWER
        if self._calls:
            out.append(f"{self._syntax.open}\n" + "\n".join(self._calls) + f"\n{self._syntax.close}")
            self._calls = []
        return "".join(out)

    def restore(self, protocol_json: str) -> str:
        """Put the real marker spellings back into parser output."""
        if SENTINEL_DSML in protocol_json or SENTINEL_THINK_END in protocol_json:
            for sentinel, spelling in self._restore.items():
                protocol_json = protocol_json.replace(sentinel, spelling)
        return protocol_json

    # -- stages ------------------------------------------------------------------------------

    def _reasoning(self, buf: str, out: list[str]) -> str:
        end = buf.find(self._think_end)
        if end >= 0:
            out.append(buf[:end].replace(self._dsml, SENTINEL_DSML) + self._think_end)
            self.stage = Stage.ANSWER
            return buf[end + len(self._think_end):]
        buf = buf.replace(self._dsml, SENTINEL_DSML)      # whole markers first, then a partial
        keep = self._partial_marker_at(buf, self._prefixes[Stage.REASONING])
        out.append(buf[:keep])
        self._held = buf[keep:]
        return ""

    def _answer(self, buf: str, out: list[str]) -> str:
        m = self._answer_marker.search(buf)
        keep = self._partial_marker_at(buf, self._prefixes[Stage.ANSWER])
        if m is None or m.start() >= keep:     # none, or inside what may become a longer marker
            out.append(buf[:keep])
            self._held = buf[keep:]
            return ""
        out.append(buf[:m.start()])
        if m.group(0) == self._syntax.open and self._parse_tool_calls:
            self.stage = Stage.TOOL_BLOCK
        else:
            out.append(self._escape(m.group(0)))
        return buf[m.end():]

    def _tool_block(self, buf: str, out: list[str]) -> str:
        search_from = max(0, len(self._block) - len(self._syntax.close) + 1)
        self._block += buf
        end = self._block.find(self._syntax.close, search_from)
        if end < 0:
            return ""
        body, rest = self._block[:end], self._block[end + len(self._syntax.close):]
        self._block = ""
        out.append(self._settle(body, complete=True))
        self.stage = Stage.ANSWER
        return rest

    def _settle(self, body: str, complete: bool) -> str:
        """Keep the valid invokes of a block; return everything else as escaped answer text."""
        text: list[str] = []
        for item in self._syntax.split_block(body, self._tool_names, complete):
            if item.problem:
                self.rejected.append(Rejected(item.raw, item.problem))
                text.append(self._escape(item.raw))
            else:
                self._calls.append(item.raw)
        return "".join(text)

    def _escape(self, text: str) -> str:
        return text.replace(self._dsml, SENTINEL_DSML).replace(self._think_end, SENTINEL_THINK_END)

    @staticmethod
    def _partial_marker_at(buf: str, prefixes: frozenset[str]) -> int:
        """Index where a trailing, possibly unfinished marker starts (len(buf) if none)."""
        longest = max(map(len, prefixes), default=0)
        for i in range(max(0, len(buf) - longest), len(buf)):
            if buf[i:] in prefixes:
                return i
        return len(buf)


def _proper_prefixes(markers: list[str]) -> frozenset[str]:
    return frozenset(m[:k] for m in markers for k in range(1, len(m)))


__all__ = ["OutputScanner", "Stage", "Rejected", "SENTINEL_DSML", "SENTINEL_THINK_END"]
