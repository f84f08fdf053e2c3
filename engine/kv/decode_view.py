"""A decode step of many paged sequences (one new token each) as batched tensor operations.

The per-sequence path reads and advances each sequence's state on its own, a few dozen small
operations per sequence per layer. Here the step's metadata (slots, positions, a padded page
table) goes to the device once per forward, and every layer reads and advances the state of the
whole batch with a fixed number of gathers and scatters, whatever the batch size:

- window: the new key goes to row p % window of each slot's ring; the window (the last `window`
  positions, the new one included) is gathered oldest first, with a mask for positions < 0;
- tails: the new token's projected kv and gate go to row p % span of each slot's tail ring; when a
  sequence completes a window this step (known on the host), the window (and, for CSA, the one
  before it) is gathered from the ring and pooled for every row, and the entry written only for the
  rows that complete one (the others write back what is there);
- entries / indexer keys: one gather of the pages that hold any visible entry [B, E, d] and a mask
  of each sequence's visible count.

No host syncs: every shape and branch depends only on host-side positions.
"""

from __future__ import annotations

import torch


class DecodeView:
    def __init__(self, states: list, captures: list | None = None, padded: tuple[int, int] | None = None,
                 meta: torch.Tensor | None = None):
        """padded = (batch, pages): fixed shapes for a CUDA graph. Rows past len(states) are scratch
        rows (the scratch slot and page, position 0), every sequence's page list is padded to
        `pages`, and every layer pools and gathers as if any window could complete and all `pages`
        held visible entries (the masks keep the results exact). meta: the device tensor to read the
        metadata from (a graph's static input, filled from `host_metadata` before each replay)."""
        first = states[0]
        self.states, self.config = states, first.config
        self.pool, self.slots, self.rings = first.pool, first.slots, first.rings
        self.block_size = self.pool.layout.block_size
        self.window_size = self.slots.window
        self.fixed = padded is not None
        self.positions = [s.num_tokens for s in states]  # the new token's position, per sequence
        if meta is None:
            meta = self.host_metadata(states, padded).to(self.pool.pages.device, non_blocking=True)  # one copy
        self.slot, self.position, self.pages = meta[:, 0], meta[:, 1], meta[:, 2:]
        self.num_rows, self.num_pages = self.pages.shape  # rows: len(states), or the padded batch
        self.captures = [(s, p[0]) for s, p in zip(states, captures or ()) if p]  # (state, boundary) pairs
        offsets = torch.arange(self.window_size, device=meta.device) - (self.window_size - 1)
        window_positions = self.position[:, None] + offsets  # [B, window], oldest first
        self.window_rows = window_positions % self.window_size
        self.window_write_row = self.window_rows[:, -1]
        self.window_valid = window_positions >= 0
        self._ratios: dict[int, _RatioMeta] = {}
        self._spans: dict[tuple[int, int], _SpanMeta] = {}

    @staticmethod
    def supports(states: list) -> bool:
        """Whether the states share one storage (one pool, window and tail rings)."""
        first = states[0]
        return all(type(s) is type(first) and s.pool is first.pool and s.rings is first.rings for s in states)

    @staticmethod
    def storage(states: list):
        """What the views of these states write to (a captured graph is bound to it)."""
        return states[0].pool

    @staticmethod
    def pages_needed(states: list) -> int:
        return max(s.num_tokens for s in states) // states[0].pool.layout.block_size + 1

    @staticmethod
    def host_metadata(states: list, padded: tuple[int, int] | None = None) -> torch.Tensor:
        """[batch, 2 + pages] on the host: each row's slot, new token's position, page table."""
        first = states[0]
        block, scratch_page = first.pool.layout.block_size, first.pool.scratch_page
        batch, num_pages = padded or (len(states), DecodeView.pages_needed(states))
        if batch < len(states) or num_pages < DecodeView.pages_needed(states):
            raise ValueError(f"padding {padded} is smaller than {len(states)} sequences / their pages")
        rows = []
        for state in states:
            pages = state.page_table[: state.num_tokens // block + 1]
            rows.append([state.slot, state.num_tokens, *pages] + [scratch_page] * (num_pages - len(pages)))
        rows += [[first.slots.scratch, 0] + [scratch_page] * num_pages] * (batch - len(states))
        return torch.tensor(rows, dtype=torch.long)

    # ---- sliding window ---------------------------------------------------------------------
    def window(self, layer: int, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Record the new keys kv [B, D]; return every sequence's window [B, window, D], oldest first,
        and its validity mask [B, window]."""
        rings = self.slots.rings
        rings[self.slot, layer, self.window_write_row] = kv.to(rings.dtype)
        return rings[self.slot[:, None], layer, self.window_rows], self.window_valid

    # ---- compressor tails -------------------------------------------------------------------
    def completes(self, ratio: int) -> bool:
        """Whether any sequence completes a window of `ratio` tokens with this token."""
        return self.ratio(ratio).any_complete

    def append_tail(self, layer: int, indexer: bool, kv: torch.Tensor, gate: torch.Tensor) -> None:
        """Record the new token's projected kv and raw gate [B, width] in each sequence's tail."""
        key = (layer, indexer)
        ring_kv, ring_gate = self.rings.kv[key], self.rings.gate[key]
        row = self._span(self.rings.shape[key][0], self.rings.span(key)).write_row
        ring_kv[self.slot, row] = kv.to(ring_kv.dtype)
        ring_gate[self.slot, row] = gate.to(ring_gate.dtype)

    def window_tokens(self, layer: int, indexer: bool):
        """(kv, gate) [B, ratio, width] of the window holding each sequence's new token, in position
        order; (kv, gate, has_previous) of the window before it (CSA tails only; else Nones); and
        each window's first position [B]. Rows past the new token are stale: use only the sequences
        that complete their window."""
        key = (layer, indexer)
        ratio, _, overlap = self.rings.shape[key]
        span = self._span(ratio, self.rings.span(key))
        ring_kv, ring_gate = self.rings.kv[key], self.rings.gate[key]
        slot = self.slot[:, None]
        current = ring_kv[slot, span.current_rows], ring_gate[slot, span.current_rows]
        previous = (None, None, None)
        if overlap:
            previous = ring_kv[slot, span.previous_rows], ring_gate[slot, span.previous_rows], span.has_previous
        return current, previous, self.ratio(ratio).window_start

    # ---- compressed entries and indexer keys ------------------------------------------------
    def write_entries(self, layer: int, indexer: bool, new: torch.Tensor) -> None:
        """new [B, d]: the entry each sequence's window pools to; kept only where the window is
        complete (the others' rows are written back unchanged: one scatter, no host sync)."""
        view = (self.pool.index_keys if indexer else self.pool.entries)[layer]
        meta = self.ratio(self.config.compress_ratio(layer))
        old = view[meta.entry_page, meta.entry_row]
        view[meta.entry_page, meta.entry_row] = torch.where(meta.complete[:, None], new.to(view.dtype), old)

    def entries(self, layer: int, indexer: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every sequence's entries (or indexer keys) [B, E, d], padded, and which are visible [B, E];
        None while no sequence sees any."""
        meta = self.ratio(self.config.compress_ratio(layer))
        if meta.num_pages == 0:
            return None
        view = (self.pool.index_keys if indexer else self.pool.entries)[layer]
        gathered = view[self.pages[:, : meta.num_pages]]  # [B, pages, rows, d]
        return gathered.flatten(1, 2), meta.visible

    def max_visible(self, ratio: int) -> int:
        """The most entries any sequence sees (with fixed shapes: an upper bound)."""
        return self.ratio(ratio).max_visible

    # ---- boundaries -------------------------------------------------------------------------
    def capture(self, layer: int) -> None:
        """Sequences whose new token ends a block save the layer's window and tails there."""
        for state, boundary in self.captures:
            state.capture(layer, boundary)

    # ---- per-step metadata, computed once per ratio / span ----------------------------------
    def ratio(self, ratio: int) -> "_RatioMeta":
        meta = self._ratios.get(ratio)
        if meta is None:
            meta = self._ratios[ratio] = _RatioMeta(self, ratio)
        return meta

    def _span(self, ratio: int, span: int) -> "_SpanMeta":
        meta = self._spans.get((ratio, span))
        if meta is None:
            meta = self._spans[ratio, span] = _SpanMeta(self, ratio, span)
        return meta


class _RatioMeta:
    """Where each sequence stands in layers of one compression ratio."""

    def __init__(self, view: DecodeView, ratio: int):
        position, device = view.position, view.position.device
        rows_per_page = view.block_size // ratio
        if view.fixed:  # shapes and branches may not depend on the positions: the masks do the work
            self.any_complete, self.num_pages = True, view.num_pages
            self.max_visible = self.num_pages * rows_per_page
        else:
            self.any_complete = any((p + 1) % ratio == 0 for p in view.positions)
            self.max_visible = max((p + 1) // ratio for p in view.positions)
            self.num_pages = -(-self.max_visible // rows_per_page)
        entry = position // ratio  # the entry the new token's window pools to
        self.complete = (position + 1) % ratio == 0
        self.window_start = entry * ratio
        self.entry_page = view.pages.gather(1, (entry // rows_per_page)[:, None]).squeeze(1)
        self.entry_row = entry % rows_per_page
        slots = torch.arange(self.num_pages * rows_per_page, device=device)
        self.visible = slots[None, :] < ((position + 1) // ratio)[:, None]


class _SpanMeta:
    """Ring rows of the new token, its window and the window before, for tails of one span."""

    def __init__(self, view: DecodeView, ratio: int, span: int):
        position = view.position
        start = position // ratio * ratio
        offsets = torch.arange(ratio, device=position.device)
        self.write_row = position % span
        self.current_rows = (start[:, None] + offsets) % span
        self.previous_rows = (start[:, None] - ratio + offsets) % span
        self.has_previous = start >= ratio
