"""Shared by the KV store tests: hash chains, pages derived from their hash, a settable clock.

Pages are what workers hand the store: bf16 pages travel as (TensorDesc, buffer) pairs (numpy has
no bfloat16), so that is how the tests make them; no torch needed.
"""
from __future__ import annotations

import numpy as np

from kvstore import SegmentStore, StoreSettings
from messages.prefix import BLOCK_TOKENS, block_hashes
from messages.tensors import TensorDesc, describe

T0 = 1_800_000_000.0     # a fixed wall-clock start (epoch seconds)
DAY = 86400.0
PAGE_NUMEL = 2048        # 4 KiB of bf16 per page: small pages, many records


class Clock:
    def __init__(self, now: float = T0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def chain(n: int, seed: int = 0, model: str = "m") -> list[bytes]:
    """The hash chain of n blocks of a prompt determined by `seed`."""
    tokens = np.random.default_rng(seed).integers(0, 100_000, n * BLOCK_TOKENS).tolist()
    return block_hashes(model, tokens)


def bf16_page(bits: np.ndarray) -> tuple[TensorDesc, memoryview]:
    """uint16 bit patterns as a bf16 page of the same shape."""
    bits = np.ascontiguousarray(bits, np.uint16)
    return TensorDesc("bfloat16", bits.shape), memoryview(bits.reshape(-1).view(np.uint8))


def page_for(key: bytes, numel: int = PAGE_NUMEL) -> tuple[TensorDesc, memoryview]:
    """A bf16 page whose every bit follows from the block hash (what the writer under test wrote)."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return bf16_page(rng.integers(0, 1 << 16, numel, dtype=np.uint16))


def pages_of(keys: list[bytes], numel: int = PAGE_NUMEL) -> list[tuple[bytes, tuple]]:
    return [(k, page_for(k, numel)) for k in keys]


def open_store(root, clock=None, **settings) -> SegmentStore:
    return SegmentStore(StoreSettings(root=str(root), **settings), clock=clock or Clock())


def same_bits(a, b) -> bool:
    """Equal dtype, shape and every byte (NaNs and signed zeros included); pages as numpy arrays,
    bytes or (TensorDesc, buffer) pairs."""
    (desc_a, bytes_a), (desc_b, bytes_b) = describe(a), describe(b)
    return desc_a == desc_b and bytes_a == bytes_b
