"""Sliding-window state: a preallocated ring per running sequence, and saved boundary states.

`SwaSlots` holds one [num_layers, window, head_dim] ring per slot; the token at position p lives
in row p % window, so a decode step writes one row per layer and never reallocates.

`BoundaryCache` keeps, in host memory, the window and compressor tails of a sequence exactly at
a 128-token boundary, keyed by the hash of the block that ends there. Block pages alone cannot
continue a sequence (the window holds raw KV of the last 128 tokens, the CSA tails the overlap of
the last window), so a prefix hit is usable only up to a boundary whose state is saved here.
LRU with a byte budget.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


class SwaSlots:
    def __init__(self, num_slots: int, num_layers: int, window: int, head_dim: int, device, dtype: torch.dtype):
        self.window = window
        self.scratch = num_slots  # one ring more, never allocated: padded rows of a decode batch write there
        self.rings = torch.zeros(num_slots + 1, num_layers, window, head_dim, device=device, dtype=dtype)
        self.free = list(range(num_slots - 1, -1, -1))
        self.num_layers = num_layers
        # per slot, per layer: the first position its ring holds (a replay's start; above the last KV
        # source, a trimmed replay's start of the upper layers)
        self.start = [[0] * num_layers for _ in range(num_slots + 1)]

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self) -> int:
        if not self.free:
            raise MemoryError("no free sliding-window slot")
        slot = self.free.pop()
        self.start[slot] = [0] * self.num_layers
        return slot

    def set_start(self, slot: int, position: int, layers=None) -> None:
        """The slot's windows of `layers` (default: all) hold nothing before `position` (bounded
        replay restarts there; a trimmed replay's upper layers start later still)."""
        starts = self.start[slot]
        for layer in range(self.num_layers) if layers is None else layers:
            starts[layer] = position

    def deallocate(self, slot: int) -> None:
        if slot in self.free:
            raise ValueError(f"slot {slot} freed twice")
        self.free.append(slot)

    def read(self, slot: int, layer: int, position: int) -> torch.Tensor:
        """KV of positions [max(layer start, position - window), position), oldest first (a copy or a view)."""
        ring = self.rings[slot, layer]
        first = self.start[slot][layer]
        if first and first > position - self.window:
            rows = torch.arange(first, max(first, position), device=ring.device) % self.window
            return ring.index_select(0, rows)
        if position <= self.window:
            return ring[:position]
        start = position % self.window
        return torch.cat([ring[start:], ring[:start]])

    def write(self, slot: int, layer: int, kv: torch.Tensor, position: int) -> None:
        """Record the KV of positions [position, position + len(kv)) (only the last `window` matter)."""
        keep = min(kv.shape[0], self.window)
        if keep == 0:
            return
        end = position + kv.shape[0]
        rows = torch.arange(end - keep, end, device=self.rings.device) % self.window
        self.rings[slot, layer].index_copy_(0, rows, kv[-keep:].to(self.rings.dtype))

    def load(self, slot: int, windows: torch.Tensor, position: int) -> None:
        """Fill a ring from windows [num_layers, min(position, window), head_dim] (oldest first)."""
        for layer in range(windows.shape[0]):
            self.write(slot, layer, windows[layer], position - windows.shape[1])


@dataclass(slots=True)
class BoundaryState:
    num_tokens: int  # a multiple of the block size
    windows: torch.Tensor  # [num_layers, min(num_tokens, window), head_dim], oldest first
    tails: torch.Tensor  # engine.kv.tails.pack_tails layout

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.windows, self.tails))


class BoundaryCache:
    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self.states: OrderedDict[bytes, BoundaryState] = OrderedDict()

    def __len__(self) -> int:
        return len(self.states)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.states

    def get(self, block_hash: bytes) -> BoundaryState | None:
        state = self.states.get(block_hash)
        if state is not None:
            self.states.move_to_end(block_hash)
        return state

    def discard(self, block_hash: bytes) -> None:
        state = self.states.pop(block_hash, None)
        if state is not None:
            self.used_bytes -= state.nbytes

    def put(self, block_hash: bytes, state: BoundaryState) -> None:
        if block_hash in self.states or state.nbytes > self.budget_bytes:
            return
        self.states[block_hash] = state
        self.used_bytes += state.nbytes
        while self.used_bytes > self.budget_bytes:
            _, evicted = self.states.popitem(last=False)
            self.used_bytes -= evicted.nbytes
