"""Keys for BlockIndex as uint64 words: what the table hashes and compares."""
from __future__ import annotations

from typing import Sequence

import numpy as np

KEY_BYTES = 32


class Keys:
    """Keys 1..32 bytes long, zero-padded: `words` [n, 2] uint64, their first 16 bytes (`w0`, `w1`
    its columns); `tail` [n, 2] uint64, the next 16 (None when every key is 16 bytes); `lens`, the
    lengths (an int when all equal, else a uint8 array)."""

    __slots__ = ("n", "words", "w0", "w1", "tail", "lens")

    def __init__(self, keys: Sequence[bytes]):
        n = len(keys)
        words = _words_if_all_16_bytes(keys, n)
        if words is not None:                                   # block hashes: the common case
            self._set(words, None, 16)
            return
        lens = np.fromiter(map(len, keys), np.int64, n)
        if n and (lens.min() < 1 or lens.max() > KEY_BYTES):
            raise ValueError(f"keys must be 1..{KEY_BYTES} bytes")
        words = np.frombuffer(b"".join(k.ljust(KEY_BYTES, b"\0") for k in keys), np.uint64).reshape(n, 4)
        self._set(words[:, :2].copy(), words[:, 2:].copy(), lens.astype(np.uint8))

    def _set(self, words: np.ndarray, tail: np.ndarray | None, lens) -> None:
        self.n, self.words, self.tail, self.lens = len(words), words, tail, lens
        self.w0, self.w1 = words[:, 0], words[:, 1]

    @classmethod
    def of(cls, words: np.ndarray, tail: np.ndarray | None, lens) -> "Keys":
        """From columns: `words` and `tail` [n, 2] uint64, `lens` an int or uint8 array."""
        out = cls.__new__(cls)
        out._set(np.ascontiguousarray(words, np.uint64), None if tail is None else np.ascontiguousarray(tail), lens)
        return out

    @classmethod
    def of_entries(cls, arr: np.ndarray) -> "Keys":
        """The keys of index entries (record.ENTRY_DTYPE: zero-padded 32-byte keys and lengths)."""
        n = len(arr)
        words = np.ascontiguousarray(arr["key"]).view(np.uint64).reshape(n, 4)
        lens = arr["key_len"].astype(np.uint8)
        if n and (lens == 16).all():
            return cls.of(words[:, :2], None, 16)
        if n and (lens.min() < 1 or lens.max() > KEY_BYTES):
            raise ValueError(f"keys must be 1..{KEY_BYTES} bytes")
        return cls.of(words[:, :2], words[:, 2:], lens)

    def take(self, index) -> "Keys":
        return Keys.of(self.words[index], None if self.tail is None else self.tail[index],
                       self.lens if isinstance(self.lens, int) else self.lens[index])

    def ids(self) -> np.ndarray:
        """A number per distinct key (equal keys, equal numbers)."""
        combo = np.empty((self.n, 5), np.uint64)
        combo[:, :2], combo[:, 2:4], combo[:, 4] = self.words, self.tail_array(), self.lens_array()
        return np.unique(combo.view("V40").reshape(self.n), return_inverse=True)[1].reshape(-1)

    def lens_array(self) -> np.ndarray:
        return np.full(self.n, self.lens, np.uint8) if isinstance(self.lens, int) else self.lens

    def tail_array(self) -> np.ndarray:
        return np.zeros((self.n, 2), np.uint64) if self.tail is None else self.tail


_SEPARATED = np.dtype([("key", "V16"), ("sep", "u1")])


def _words_if_all_16_bytes(keys: Sequence[bytes], n: int) -> np.ndarray | None:
    """The keys as [n, 2] uint64 if every one is 16 bytes long, else None.

    Two joins instead of a len() per key (that costs more than a join): joined with a 0 byte after
    each key, then with a 1 byte. If every 17th byte is 0 in the first and not in the second, each of
    those is a separator (a key's byte would be the same in both); there are n separators, so they
    are all there, one after every 16 bytes: every key is 16 bytes."""
    if not n:
        return np.zeros((0, 2), np.uint64)
    zeros = b"\0".join(keys) + b"\0"
    if len(zeros) != 17 * n:
        return None
    zeros = np.frombuffer(zeros, _SEPARATED)
    ones = np.frombuffer(b"\1".join(keys) + b"\1", _SEPARATED)
    if zeros["sep"].any() or not ones["sep"].all():
        return None
    return np.ascontiguousarray(zeros["key"]).view(np.uint64).reshape(n, 2)
