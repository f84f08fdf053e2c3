"""One sequence's state in shared storage: block KV through a page table, the window in a ring slot,
compressor tails as small per-sequence tensors. Implements `engine.model.state.SequenceKV`."""

from __future__ import annotations

import torch

from engine.kv.page_pool import PagePool
from engine.kv.swa import BoundaryState, SwaSlots
from engine.kv.tails import Tails, clone_tails, pack_tails, unpack_tails
from engine.model.config import CSA, ModelConfig
from engine.model.state import PoolerTail, empty_tail


class PagedState:
    def __init__(self, config: ModelConfig, pool: PagePool, slots: SwaSlots, slot: int):
        self.config, self.pool, self.slots, self.slot = config, pool, slots, slot
        self.num_tokens = 0
        self.page_table: list[int] = []
        self.tails: Tails = _empty_tails(config, pool.pages.device, pool.pages.dtype)
        self.captured: dict[int, list] = {}  # boundary -> per layer (window, tail, index tail) copies
        self._page_index = torch.empty(0, dtype=torch.long, device=pool.pages.device)

    # ---- SequenceKV -------------------------------------------------------------------------
    def window(self, layer: int, position: int) -> torch.Tensor:
        return self.slots.read(self.slot, layer, position)

    def append_window(self, layer: int, kv: torch.Tensor, position: int) -> None:
        self.slots.write(self.slot, layer, kv, position)

    def entries(self, layer: int, count: int) -> torch.Tensor:
        return PagePool.gather(self.pool.entries[layer], self.page_index(), count)

    def write_entries(self, layer: int, first: int, new: torch.Tensor) -> None:
        PagePool.scatter(self.pool.entries[layer], self.page_index(), first, new)

    def index_keys(self, layer: int, count: int) -> torch.Tensor:
        return PagePool.gather(self.pool.index_keys[layer], self.page_index(), count)

    def write_index_keys(self, layer: int, first: int, new: torch.Tensor) -> None:
        PagePool.scatter(self.pool.index_keys[layer], self.page_index(), first, new)

    def tail(self, layer: int) -> PoolerTail | None:
        return self.tails[layer][0]

    def index_tail(self, layer: int) -> PoolerTail | None:
        return self.tails[layer][1]

    def capture(self, layer: int, position: int) -> None:
        tail, index_tail = self.tails[layer]
        copies = (self.window(layer, position).clone(), *clone_tails([(tail, index_tail)])[0])
        self.captured.setdefault(position, [None] * self.config.num_layers)[layer] = copies

    # ---- pages, boundaries, export ------------------------------------------------------------
    def page_index(self) -> torch.Tensor:
        if self._page_index.numel() != len(self.page_table):
            self._page_index = torch.tensor(self.page_table, dtype=torch.long, device=self.pool.pages.device)
        return self._page_index

    def take_captures(self, host=torch.device("cpu")) -> list[BoundaryState]:
        """The boundary states captured by the last forward (moved to `host`), oldest first."""
        states = []
        for position in sorted(self.captured):
            layers = self.captured[position]
            windows = torch.stack([layer[0] for layer in layers]).to(host)
            tails = pack_tails([(layer[1], layer[2]) for layer in layers], self.config, position, windows.dtype)
            tails = tails.to(host)
            states.append(BoundaryState(position, windows, tails))
        self.captured.clear()
        return states

    def boundary_state(self) -> BoundaryState:
        """Window and tails as they stand now (any length; `BoundaryState` is exact at boundaries)."""
        layers = range(self.config.num_layers)
        windows = torch.stack([self.window(layer, self.num_tokens) for layer in layers])
        tails = pack_tails(self.tails, self.config, self.num_tokens, self.pool.pages.dtype)
        return BoundaryState(self.num_tokens, windows, tails)

    def load(self, state: BoundaryState) -> None:
        """Set window, tails and length from a saved state (pages must already be in the table)."""
        if -(-state.num_tokens // self.pool.layout.block_size) > len(self.page_table):
            raise ValueError(f"{state.num_tokens} tokens need more than {len(self.page_table)} pages")
        self.slots.load(self.slot, state.windows.to(self.pool.pages.device), state.num_tokens)
        device, dtype = self.pool.pages.device, self.pool.pages.dtype
        self.tails = unpack_tails(state.tails, self.config, state.num_tokens, device, dtype)
        self.num_tokens = state.num_tokens


def _empty_tails(config: ModelConfig, device, dtype) -> Tails:
    tails: Tails = []
    for layer in range(config.num_layers):
        kind = config.layer_types[layer]
        tail = empty_tail(config.head_dim, kind == CSA, device, dtype) if config.compress_ratio(layer) else None
        index_tail = empty_tail(config.index_head_dim, True, device, dtype) if kind == CSA else None
        tails.append((tail, index_tail))
    return tails
