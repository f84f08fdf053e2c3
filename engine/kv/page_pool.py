"""The preallocated storage of block KV: `num_pages` pages, each one block of every layer.

A page is one row of a single [num_pages, page_numel] tensor. Inside the row each compressed
layer owns a slice: its entries (block_size / ratio rows of head_dim), then for compressed-sparse
layers the indexer keys (block_size / ratio rows of index_head_dim). Per-layer views let attention
gather and scatter through a page table; a whole page exports as one contiguous row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.models.spec import CacheSpec
from messages.prefix import BLOCK_TOKENS


@dataclass(frozen=True, slots=True)
class LayerSlice:
    offset: int  # first element of the layer's entries inside a page
    rows: int  # entries per page (block_size // ratio)
    index_offset: int = -1  # first element of its indexer keys (CSA only)


@dataclass(frozen=True, slots=True)
class PageLayout:
    block_size: int
    head_dim: int
    index_head_dim: int
    layers: tuple[LayerSlice | None, ...]  # None for sliding-only layers
    page_numel: int

    @classmethod
    def from_config(cls, config: CacheSpec, block_size: int = BLOCK_TOKENS) -> "PageLayout":
        slices, offset = [], 0
        for layer in range(config.num_layers):
            ratio = config.compress_ratio(layer)
            if ratio == 0:
                slices.append(None)
                continue
            if block_size % ratio:
                raise ValueError(f"block size {block_size} is not a multiple of layer {layer}'s ratio {ratio}")
            rows = block_size // ratio
            entries_at, offset = offset, offset + rows * config.head_dim
            index_at = -1
            if config.owns_index_keys(layer):
                index_at, offset = offset, offset + rows * config.index_head_dim
            slices.append(LayerSlice(entries_at, rows, index_at))
        return cls(block_size, config.head_dim, config.index_head_dim, tuple(slices), offset)

    def page_bytes(self, dtype: torch.dtype) -> int:
        return self.page_numel * torch.empty((), dtype=dtype).element_size()


class PagePool:
    def __init__(self, layout: PageLayout, num_pages: int, device, dtype: torch.dtype):
        self.layout, self.num_pages = layout, num_pages
        self.scratch_page = num_pages  # one page more, never allocated: padded rows of a decode batch write there
        self.pages = torch.zeros(num_pages + 1, layout.page_numel, device=device, dtype=dtype)
        self.entries: list[torch.Tensor | None] = []  # per layer [num_pages, rows, head_dim] views
        self.index_keys: list[torch.Tensor | None] = []
        for s in layout.layers:
            self.entries.append(None if s is None else self._view(s.offset, s.rows, layout.head_dim))
            csa = s is not None and s.index_offset >= 0
            self.index_keys.append(self._view(s.index_offset, s.rows, layout.index_head_dim) if csa else None)

    @classmethod
    def pages_for_bytes(cls, layout: PageLayout, budget_bytes: int, dtype: torch.dtype) -> int:
        """How many pages a byte budget holds."""
        return budget_bytes // max(1, layout.page_bytes(dtype))

    def _view(self, offset: int, rows: int, width: int) -> torch.Tensor:
        return self.pages[:, offset : offset + rows * width].view(self.pages.shape[0], rows, width)

    def read_pages(self, page_ids: list[int]) -> torch.Tensor:
        """[len(page_ids), page_numel] copy (contiguous, on the pool's device)."""
        return self.pages[torch.tensor(page_ids, dtype=torch.long, device=self.pages.device)]

    def write_pages(self, page_ids: list[int], data: torch.Tensor) -> None:
        if data.shape != (len(page_ids), self.layout.page_numel):
            raise ValueError(f"page data {tuple(data.shape)} != ({len(page_ids)}, {self.layout.page_numel})")
        index = torch.tensor(page_ids, dtype=torch.long, device=self.pages.device)
        self.pages.index_copy_(0, index, data.to(device=self.pages.device, dtype=self.pages.dtype))

    @staticmethod
    def gather(view: torch.Tensor, page_index: torch.Tensor, count: int) -> torch.Tensor:
        """The first `count` rows of a sequence whose pages are page_index (in order)."""
        rows = view.shape[1]
        used = -(-count // rows)
        return view[page_index[:used]].reshape(used * rows, view.shape[2])[:count]

    @staticmethod
    def scatter(view: torch.Tensor, page_index: torch.Tensor, first: int, new: torch.Tensor) -> None:
        """Write rows first... of a sequence whose pages are page_index."""
        if new.shape[0] == 0:
            return
        rows = view.shape[1]
        row = torch.arange(first, first + new.shape[0], device=page_index.device)
        view[page_index[row // rows], row % rows] = new.to(view.dtype)
