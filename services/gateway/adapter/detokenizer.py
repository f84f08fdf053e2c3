"""Token ids -> text, incrementally, with UTF-8 sequences split across tokens held back.

The table is built once per tokenizer.json (byte-level BPE: each vocabulary string maps back to
bytes through GPT-2's byte<->unicode table; added tokens decode to their literal spelling).
The adapter owns this so it can see the text before deciding what the stream parser gets.
"""
from __future__ import annotations

import codecs
import json

REPLACEMENT = "\ufffd"


def _unicode_to_byte() -> dict[str, int]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class TokenTable:
    """The bytes of every token id, plus the ids of added (special) tokens by spelling."""

    def __init__(self, tokenizer_json: str) -> None:
        spec = json.loads(tokenizer_json)
        to_byte = _unicode_to_byte()
        vocab: dict[str, int] = spec["model"]["vocab"]
        added = {t["id"]: t["content"] for t in spec.get("added_tokens", [])}
        size = max([*vocab.values(), *added, -1]) + 1
        self.token_bytes: list[bytes] = [b""] * size
        for piece, token_id in vocab.items():
            self.token_bytes[token_id] = bytes(to_byte.get(ch, 0x3F) for ch in piece)
        for token_id, content in added.items():
            self.token_bytes[token_id] = content.encode()
        self.added_ids: dict[str, int] = {content: token_id for token_id, content in added.items()}

    @classmethod
    def from_file(cls, path: str) -> "TokenTable":
        with open(path, encoding="utf-8") as f:
            return cls(f.read())

    def bytes_of(self, token_id: int) -> bytes:
        if 0 <= token_id < len(self.token_bytes):
            return self.token_bytes[token_id]
        return REPLACEMENT.encode()      # an id outside the vocabulary shows as U+FFFD

    def decode(self, token_ids: list[int]) -> str:
        return b"".join(self.bytes_of(t) for t in token_ids).decode("utf-8", errors="replace")


class IncrementalDetokenizer:
    """feed(token_id) -> the text it completes ('' while a UTF-8 sequence is still open)."""

    def __init__(self, table: TokenTable) -> None:
        self._table = table
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._utf8.decode(self._table.bytes_of(token_id))

    @property
    def pending(self) -> bool:
        """True while bytes of an unfinished UTF-8 sequence are buffered."""
        return bool(self._utf8.getstate()[0])

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
