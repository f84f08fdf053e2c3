"""Engram's compressed vocabulary: token ids that read alike share one id.

Engram hashes n-grams over these ids, so " The", "the" and "THE" hash the same. Each token is
decoded on its own and normalized (NFKC, NFD, accents stripped, lowercase, whitespace runs
collapsed, outer whitespace stripped, but a token that is exactly whitespace stays one space).
Tokens whose decoding is a partial UTF-8 sequence are keyed by their raw token string instead.
Compressed ids are handed out in token-id order of first appearance. The count matters beyond
bounds checks: every hash multiplier derives from it, so a different tokenizer silently rehashes
the released tables (checked against `engram_compressed_vocab_size`).

Building the map takes about 1.5 s for a 129k vocabulary; it is cached per tokenizer file content.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

_WHITESPACE_MARK = "\ue000"  # a private-use char that survives Strip()
_cache: dict[str, "CompressedVocab"] = {}
_cache_lock = threading.Lock()


@dataclass(frozen=True)
class CompressedVocab:
    token_map: torch.Tensor  # [tokenizer vocab] int64: token id -> compressed id
    size: int  # number of distinct compressed ids
    digest: str  # sha256 of the tokenizer.json it came from

    def __len__(self) -> int:
        return self.token_map.numel()


def tokenizer_digest(tokenizer_json: str | Path) -> str:
    return hashlib.sha256(Path(tokenizer_json).read_bytes()).hexdigest()


def compressed_vocab(tokenizer_json: str | Path) -> CompressedVocab:
    """The compressed map of a tokenizer.json (built once per file content in this process)."""
    data = Path(tokenizer_json).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    with _cache_lock:
        if digest not in _cache:
            token_map, size = _build(data.decode("utf-8"))
            _cache[digest] = CompressedVocab(token_map, size, digest)
        return _cache[digest]


def _normalizer():
    from tokenizers import Regex, normalizers

    steps = normalizers
    return steps.Sequence([
        steps.NFKC(),
        steps.NFD(),
        steps.StripAccents(),
        steps.Lowercase(),
        steps.Replace(Regex(r"[ \t\r\n]+"), " "),
        steps.Replace(Regex(r"^ $"), _WHITESPACE_MARK),
        steps.Strip(),
        steps.Replace(_WHITESPACE_MARK, " "),
    ])


def _build(tokenizer_json_text: str) -> tuple[torch.Tensor, int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json_text)
    normalize = _normalizer().normalize_str
    ids_by_key: dict[str, int] = {}
    token_map = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:  # a lone byte of a multi-byte character: key it by its raw form
            key = tokenizer.id_to_token(token_id)
        else:
            key = normalize(text) or text
        token_map.append(ids_by_key.setdefault(key, len(ids_by_key)))
    return torch.tensor(token_map, dtype=torch.long), len(ids_by_key)
