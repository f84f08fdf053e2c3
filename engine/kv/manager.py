"""The engine's KV memory: page pool + block manager + window slots + saved boundary states.

The scheduler asks it `can_admit / admit`, `can_append / append`, `release`; after each forward
`commit` indexes the blocks a sequence completed and saves the boundary states it captured.

Prefix hits: a waiting sequence reuses the longest chain of cached pages matching its block
hashes, cut back to the last boundary whose window + tails are saved in the boundary cache (see
swa.py), and never the whole prompt (the last prompt token is always computed, for its logits).

Bounded replay (V4.1; docs/design/serving.md, vLLM's `swa_bounded_replay`): when the pages reach further than
any saved window, the sequence takes all the pages and recomputes the last block's 128 tokens to
rebuild the window, each token's window clamped at the replay start; the cached compressed pages
are not rewritten (`PagedState.frozen_until`). Approximate by design: `epd replay-check` measures it.
With `replay_trim` (the decoder side of DeepSeek's replay) the layers above the last KV source run only on the
prompt's last `window` rows (`PagedState.trim_from`; their windows start there), and no boundary
state of that prefill is saved: its upper windows serve this request's decode, never the prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv.block_manager import BlockManager
from engine.kv.page_pool import PageLayout, PagePool
from engine.kv.paged_state import PagedState
from engine.kv.swa import BoundaryCache, BoundaryState, SwaSlots
from engine.kv.tails import TailRings
from engine.models.spec import CacheSpec
from messages.prefix import BLOCK_TOKENS


@dataclass(slots=True)
class Hit:
    """Where an admitted sequence starts: `tokens` already computed, from shared pages (a prefix
    hit) or from restored page data (a hand-off)."""

    tokens: int = 0
    pages: tuple[int, ...] = ()  # cached pages shared with other sequences
    boundary: BoundaryState | None = None
    page_data: torch.Tensor | None = None  # restored pages [n, page_numel], copied into new pages
    replay_end: int = 0  # bounded replay: the pages cover [0, replay_end); tokens = replay_end - 128
    window_cacheable: bool = True  # a hand-off's window may enter the prefix cache (see Restored)


@dataclass(slots=True)
class Restored:
    """A hand-off waiting for admission: its pages, window and tails as received."""

    page_data: torch.Tensor
    boundary: BoundaryState
    window_cacheable: bool = True  # False: from a trimmed replay prefill; continue from it, never cache it


class KVCache:
    def __init__(self, config: CacheSpec, num_pages: int, num_slots: int, device, dtype: torch.dtype,
                 enable_prefix_cache: bool = True, boundary_cache_bytes: int = 1 << 30, block_size: int = BLOCK_TOKENS,
                 bounded_replay: bool = True, replay_trim: bool = True):
        self.config, self.block_size = config, block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.replay = bounded_replay and config.supports_bounded_replay
        # layers a trimmed replay runs on its last `window` rows only: those above the last KV source
        last_source = config.last_kv_source
        trims = self.replay and replay_trim and last_source >= 0
        self.trimmed_layers = range(last_source + 1, config.num_layers) if trims else range(0)
        self.layout = PageLayout.from_config(config, block_size)
        self.pool = PagePool(self.layout, num_pages, device, dtype)
        self.blocks = BlockManager(num_pages)
        self.slots = SwaSlots(num_slots, config.num_layers, config.sliding_window, config.head_dim, device, dtype)
        self.tail_rings = TailRings(config, num_slots, device, dtype)  # slot i's tails go with window slot i
        self.boundaries = BoundaryCache(boundary_cache_bytes)

    # ---- admission --------------------------------------------------------------------------
    def find_hit(self, seq) -> Hit:
        """Where `seq` (waiting) can start: its hand-off, else its longest usable cached prefix."""
        if seq.restored is not None:
            r = seq.restored
            return Hit(r.boundary.num_tokens, (), r.boundary, r.page_data, window_cacheable=r.window_cacheable)
        if not self.enable_prefix_cache:
            return Hit()
        usable_blocks = (len(seq.token_ids) - 1) // self.block_size
        pages = self.blocks.lookup(seq.block_hashes[:usable_blocks])
        replay = not seq.exact_prefix
        for count in range(len(pages), 0, -1):
            if self._replays(len(pages), count, replay):
                break
            boundary = self.boundaries.get(seq.block_hashes[count - 1])
            if boundary is not None:
                return Hit(count * self.block_size, tuple(pages[:count]), boundary)
        if self._replays(len(pages), 0, replay):
            end = len(pages) * self.block_size
            return Hit(end - self.block_size, tuple(pages), replay_end=end)
        return Hit()

    def _replays(self, num_pages: int, exact_blocks: int, allowed: bool = True) -> bool:
        """Replaying the last of `num_pages` cached blocks starts later than an exact hit of
        `exact_blocks` (as in vLLM: hits of one block or less are not worth a replay)."""
        return allowed and self.replay and num_pages >= 2 and num_pages - 1 > exact_blocks

    def can_admit(self, seq, hit: Hit, num_new: int) -> bool:
        new_pages = max(0, self._pages_for(hit.tokens + num_new) - len(hit.pages))
        return self.slots.num_free > 0 and self.blocks.can_allocate(new_pages + self.blocks.cost_to_share(hit.pages))

    def admit(self, seq, hit: Hit, num_new: int) -> None:
        """Give `seq` a window slot, its hit pages and pages for `num_new` more tokens."""
        state = PagedState(self.config, self.pool, self.slots, self.tail_rings, self.slots.allocate())
        self.blocks.share(hit.pages)
        state.page_table = list(hit.pages)
        state.page_table += self._allocate(max(0, self._pages_for(hit.tokens + num_new) - len(hit.pages)))
        if hit.page_data is not None:
            self.pool.write_pages(state.page_table[: hit.page_data.shape[0]], hit.page_data)
            if self.enable_prefix_cache and hit.tokens % self.block_size == 0 and hit.window_cacheable:  # at a boundary
                b = hit.boundary
                saved = BoundaryState(b.num_tokens, b.windows.clone(), b.tails.clone())
                self.boundaries.put(seq.block_hashes[hit.tokens // self.block_size - 1], saved)
        if hit.boundary is not None:
            state.load(hit.boundary)
        if hit.replay_end:
            state.num_tokens, state.frozen_until = hit.tokens, hit.replay_end
            self.slots.set_start(state.slot, hit.tokens)  # windows hold nothing before the replay start
            if self.trimmed_layers:  # a replay is a prompt prefill: it ends at len(token_ids)
                end = len(seq.token_ids)
                state.trim_from, state.trim_end = max(hit.tokens, end - self.config.sliding_window), end
                self.slots.set_start(state.slot, state.trim_from, self.trimmed_layers)
        context = self.config.engram_context  # ids the next token's n-grams look back at (V4.1)
        state.recent_ids = list(seq.token_ids[max(0, hit.tokens - context) : hit.tokens]) if context else []
        seq.state, seq.num_computed, seq.restored = state, hit.tokens, None
        seq.num_registered_blocks = len(hit.pages)

    def can_append(self, seq, num_new: int) -> bool:
        return self.blocks.can_allocate(self._pages_for(seq.num_computed + num_new) - len(seq.state.page_table))

    def append(self, seq, num_new: int) -> None:
        state = seq.state
        state.page_table += self._allocate(max(0, self._pages_for(seq.num_computed + num_new) - len(state.page_table)))

    def release(self, seq) -> None:
        """Return a sequence's pages (full, indexed ones stay cached) and its window slot."""
        if seq.state is None:
            return
        self.blocks.deallocate(seq.state.page_table)
        self.slots.deallocate(seq.state.slot)
        seq.state = None

    # ---- after a forward --------------------------------------------------------------------
    def capture_positions(self, seq, num_new: int) -> tuple[int, ...]:
        """Block boundaries the next `num_new` tokens reach whose state is not saved yet (none up to
        the end of a trimmed replay prefill)."""
        if not self.enable_prefix_cache:
            return ()
        first = max(seq.num_computed, seq.state.trim_end) // self.block_size + 1
        last = (seq.num_computed + num_new) // self.block_size
        return tuple(b * self.block_size for b in range(first, last + 1)
                     if seq.block_hashes[b - 1] not in self.boundaries)

    def commit(self, seq) -> None:
        """Index the full blocks computed so far and save the boundary states captured."""
        state = seq.state
        if self.enable_prefix_cache:
            for block in range(seq.num_registered_blocks, seq.num_computed // self.block_size):
                self.blocks.register(state.page_table[block], seq.block_hashes[block])
            seq.num_registered_blocks = max(seq.num_registered_blocks, seq.num_computed // self.block_size)
        for boundary in state.take_captures():
            self.boundaries.put(seq.block_hashes[boundary.num_tokens // self.block_size - 1], boundary)

    # ---- import (a prefix computed elsewhere) -------------------------------------------------
    def import_blocks(self, hashes: list[bytes], pages: list[torch.Tensor]) -> int:
        """Index the chain `hashes` (block i's page data `pages[i]`, flat) as cached, unreferenced
        pages. Blocks already indexed are kept as they are; allocation may evict other cached blocks
        (never this chain's). Returns how many leading blocks of the chain are indexed afterwards
        (fewer than asked when the pool cannot hold them all)."""
        if not self.enable_prefix_cache or not hashes:
            return 0
        present = {i: self.blocks.hash_to_page[h] for i, h in enumerate(hashes) if h in self.blocks.hash_to_page}
        self.blocks.share(present.values())  # pinned: the allocation below must not evict them
        missing = [i for i in range(len(hashes)) if i not in present]
        count = min(len(missing), len(self.blocks.free) + len(self.blocks.cached))
        chosen, new_pages = missing[:count], self._allocate(count) if count else []
        if new_pages:
            self.pool.write_pages(new_pages, torch.stack([pages[i].reshape(-1) for i in chosen]))
            for i, page in zip(chosen, new_pages):
                self.blocks.register(page, hashes[i])
        refs = present | dict(zip(chosen, new_pages))
        leading = next((i for i in range(len(hashes)) if i not in refs), len(hashes))
        # drop the pins and allocation references in chain order, so the chain's tail is evicted first
        self.blocks.deallocate([refs[i] for i in sorted(refs)])
        return leading

    def save_boundary(self, block_hash: bytes, state: BoundaryState) -> bool:
        """Keep a boundary state from outside for an indexed block; False if the block is not indexed
        (a state without its pages is no usable hit) or the state does not fit the budget."""
        if not self.enable_prefix_cache or block_hash not in self.blocks.hash_to_page:
            return False
        self.boundaries.put(block_hash, state)
        return block_hash in self.boundaries

    def usable_prefix(self, hashes: list[bytes]) -> int:
        """Tokens of the prefix `hashes` a request extending it would take from the cache: the cached
        pages cut back to the last boundary with a saved state (find_hit's rule)."""
        if not self.enable_prefix_cache:
            return 0
        num_pages = len(self.blocks.lookup(hashes))
        for count in range(num_pages, 0, -1):
            if self._replays(num_pages, count):
                break
            if hashes[count - 1] in self.boundaries:
                return count * self.block_size
        return (num_pages - 1) * self.block_size if self._replays(num_pages, 0) else 0

    # ---- export -----------------------------------------------------------------------------
    def read_pages(self, seq, count: int) -> torch.Tensor:
        """The sequence's first `count` pages as one CPU tensor [count, page_numel]."""
        return self.pool.read_pages(seq.state.page_table[:count]).cpu()

    def _allocate(self, count: int) -> list[int]:
        """Pages from the block manager; saved boundary states of evicted blocks go with them."""
        pages = self.blocks.allocate(count)
        for block_hash in self.blocks.evicted:
            self.boundaries.discard(block_hash)
        self.blocks.evicted.clear()
        return pages

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
