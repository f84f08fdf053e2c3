"""One sequence's state in shared storage: block KV through a page table, the window and the
compressor tails in rings of its slot. Implements `engine.models.spec.SequenceKV`; a batch of them
decodes through one `DecodeView`."""

from __future__ import annotations

import torch

from engine.kv.decode_view import DecodeView
from engine.kv.page_pool import PagePool
from engine.kv.swa import BoundaryState, SwaSlots
from engine.kv.tails import TailRings, Tails, pack_tails, unpack_tails
from engine.models.common.tail import PoolerTail
from engine.models.spec import CacheSpec


class PagedState:
    decode_view_type = DecodeView  # how a decode step of paged states runs batched (see DeepseekV4.forward)

    def __init__(self, config: CacheSpec, pool: PagePool, slots: SwaSlots, rings: TailRings, slot: int):
        self.config, self.pool, self.slots, self.rings, self.slot = config, pool, slots, rings, slot
        self.num_tokens = 0
        self.frozen_until = 0  # bounded replay: compressed KV of tokens before this is cached; never rewritten
        # trimmed replay (KVCache.admit): rows before trim_from skip the layers above the last KV source,
        # and no boundary up to trim_end (the prompt's end) is saved: upper windows there are cut at trim_from
        self.trim_from = self.trim_end = 0
        self.recent_ids: list[int] = []  # the last `config.engram_context` token ids (V4.1's Engram looks back)
        self.page_table: list[int] = []
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
        first, new = self._unfrozen(layer, first, new)
        if new.shape[0]:
            PagePool.scatter(self.pool.entries[layer], self.page_index(), first, new)

    def index_keys(self, layer: int, count: int) -> torch.Tensor:
        return PagePool.gather(self.pool.index_keys[layer], self.page_index(), count)

    def write_index_keys(self, layer: int, first: int, new: torch.Tensor) -> None:
        first, new = self._unfrozen(layer, first, new)
        if new.shape[0]:
            PagePool.scatter(self.pool.index_keys[layer], self.page_index(), first, new)

    def _unfrozen(self, layer: int, first: int, new: torch.Tensor) -> tuple[int, torch.Tensor]:
        """The rows of a write that do not fall in shared cached pages a replay must leave alone."""
        frozen = self.frozen_until // self.config.compress_ratio(layer) - first
        if frozen <= 0:
            return first, new
        return first + frozen, new[frozen:]

    def tail(self, layer: int, position: int, indexer: bool = False) -> PoolerTail | None:
        key = (layer, indexer)
        return self.rings.read(self.slot, key, position) if key in self.rings.shape else None

    def set_tail(self, layer: int, position: int, tail: PoolerTail, indexer: bool = False) -> None:
        self.rings.write(self.slot, (layer, indexer), position, tail)

    def capture(self, layer: int, position: int) -> None:
        tail, index_tail = self.tail(layer, position), self.tail(layer, position, indexer=True)  # copies
        copies = (self.window(layer, position).clone(), tail, index_tail)
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
        tails = pack_tails(self._tails(self.num_tokens), self.config, self.num_tokens, self.pool.pages.dtype)
        return BoundaryState(self.num_tokens, windows, tails)

    def load(self, state: BoundaryState) -> None:
        """Set window, tails and length from a saved state (pages must already be in the table)."""
        if -(-state.num_tokens // self.pool.layout.block_size) > len(self.page_table):
            raise ValueError(f"{state.num_tokens} tokens need more than {len(self.page_table)} pages")
        self.slots.load(self.slot, state.windows.to(self.pool.pages.device), state.num_tokens)
        device, dtype = self.pool.pages.device, self.pool.pages.dtype
        tails = unpack_tails(state.tails, self.config, state.num_tokens, device, dtype)
        for layer, (tail, index_tail) in enumerate(tails):
            for indexer, t in ((False, tail), (True, index_tail)):
                if t is not None:
                    self.set_tail(layer, state.num_tokens, t, indexer)
        self.num_tokens = state.num_tokens

    def _tails(self, position: int) -> Tails:
        return [(self.tail(layer, position), self.tail(layer, position, indexer=True))
                for layer in range(self.config.num_layers)]
