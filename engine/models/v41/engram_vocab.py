"""Engram's compressed vocabulary: token ids that read alike share one id.

Engram hashes n-grams over these ids, so " The", "the" and "THE" hash the same. Each token is
decoded on its own and normalized (NFKC, NFD, accents stripped, lowercase, whitespace runs
collapsed, outer whitespace stripped, but a token that is exactly whitespace stays one space).
Tokens whose decoding is a partial UTF-8 sequence are keyed by their raw token string instead.
Compressed ids are handed out in token-id order of first appearance. The count matters beyond
bounds checks: every hash multiplier derives from it, so a different tokenizer silently rehashes
the released tables (checked against `engram_compressed_vocab_size`).

Building the map takes about 1 s of CPU for a 129k vocabulary, which every worker process would pay
at start: it is kept per tokenizer file content, in this process and on disk (`cache_dir()`, one
.npy file named by the content's sha256 and the build's version; a file that does not read back as a valid map is rebuilt).
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

_WHITESPACE_MARK = "\ue000"  # a private-use char that survives Strip()
# In the kept files' names: bump it with any change to what _build or _normalizer return, or a warm
# cache would keep serving the old map (wrong Engram rows, silently)
_BUILD_VERSION = 1
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
    """The compressed map of a tokenizer.json (built once per file content, then read back)."""
    data = Path(tokenizer_json).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    with _cache_lock:
        if digest not in _cache:
            token_map = _read_cached(digest)
            if token_map is None:
                token_map, _ = _build(data.decode("utf-8"))
                _write_cached(digest, token_map)
            _cache[digest] = CompressedVocab(token_map, int(token_map.max()) + 1, digest)
        return _cache[digest]


def cache_dir() -> Path:
    """Where built maps are kept: $EPD_CACHE_DIR, else ~/.cache/epd."""
    return Path(os.environ.get("EPD_CACHE_DIR") or Path.home() / ".cache" / "epd") / "engram-vocab"


def _kept_path(digest: str) -> Path:
    return cache_dir() / f"{digest}.v{_BUILD_VERSION}.npy"


def _read_cached(digest: str) -> torch.Tensor | None:
    """A kept map, or None when there is none or it is not a valid one (ids 0..size-1, each first
    seen in token order, as _build hands them out)."""
    try:
        values = np.load(_kept_path(digest), allow_pickle=False)
    except (OSError, ValueError):
        return None
    if values.dtype != np.int64 or values.ndim != 1 or not values.size or values[0] != 0:
        return None
    if not (np.diff(np.maximum.accumulate(values)) <= 1).all() or values.min() < 0:
        return None
    return torch.from_numpy(values)


def _write_cached(digest: str, token_map: torch.Tensor) -> None:
    """Keep the map for the next process; a cache that cannot be written (read-only home) is skipped."""
    target = _kept_path(digest)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.stem}.{os.getpid()}.partial.npy")
        np.save(partial, token_map.numpy(), allow_pickle=False)
        os.replace(partial, target)   # whole or absent: a reader never sees half a file
    except OSError:
        pass


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
