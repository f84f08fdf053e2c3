"""Shared by the KV writer tests: hash chains, pages derived from their hash, a settable clock."""
from __future__ import annotations

import torch

from engine.kv.prefix_hash import block_hashes
from services.kv_writer import SegmentStore, StoreSettings

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
    """The hash chain of n 128-token blocks of a prompt determined by `seed`."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 100_000, (n * 128,), generator=g).tolist()
    return block_hashes(model, tokens)


def page_for(key: bytes, numel: int = PAGE_NUMEL) -> torch.Tensor:
    """A bf16 page whose every bit follows from the block hash (what the writer under test wrote)."""
    g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & (2**63 - 1))
    return torch.randn(numel, generator=g).to(torch.bfloat16)


def pages_of(keys: list[bytes], numel: int = PAGE_NUMEL) -> list[tuple[bytes, torch.Tensor]]:
    return [(k, page_for(k, numel)) for k in keys]


def open_store(root, clock=None, **settings) -> SegmentStore:
    return SegmentStore(StoreSettings(root=str(root), **settings), clock=clock or Clock())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and every byte (NaNs and signed zeros included)."""
    as_bytes = lambda t: t.contiguous().reshape(-1).view(torch.uint8)   # noqa: E731
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))
