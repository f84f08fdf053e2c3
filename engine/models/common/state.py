"""Per-sequence model state, kept explicit so a paged KV pool can own the storage later.

For every layer a sequence holds:
- `window`: KV of its last `sliding_window` tokens (all layers; the sliding-window branch).
- `entries`: compressed KV, one per `ratio` tokens (CSA ratio 4, HCA ratio 128); block KV.
- `index_keys`: lightning-indexer keys, one per CSA entry; block KV.
- `tail` / `index_tail`: compressor tokens not yet pooled (fewer than `ratio`, empty at a
  128-token boundary) and, for CSA, the overlap half of the last full window (always needed).

`split_state` / `join_state` cut a state at a block boundary into pages of block KV + the SWA
windows + the tails, and rebuild it; a rebuilt state continues bit-identically.

Attention reaches a state only through the `engine.models.spec.SequenceKV` methods, so storage is the state's
business: `SequenceState` keeps contiguous tensors (the simple oracle); `engine.kv.PagedState`
keeps block KV in pool pages through a page table, and the window and the tails in per-slot rings
(which also lets a decode step of many paged sequences run batched: `engine.kv.decode_view`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from engine.models.common.tail import PoolerTail, empty_tail, tail_tensors
from engine.models.spec import CacheSpec


@dataclass(slots=True)
class LayerState:
    window: torch.Tensor  # [<= sliding_window, head_dim]
    entries: torch.Tensor | None = None  # [num_tokens // ratio, head_dim]
    tail: PoolerTail | None = None
    index_keys: torch.Tensor | None = None  # [num_tokens // ratio, index_head_dim]
    index_tail: PoolerTail | None = None

    def clone(self) -> "LayerState":
        return LayerState(
            window=self.window.clone(),
            entries=_clone(self.entries),
            tail=None if self.tail is None else self.tail.clone(),
            index_keys=_clone(self.index_keys),
            index_tail=None if self.index_tail is None else self.index_tail.clone(),
        )


@dataclass(slots=True)
class SequenceState:
    """Contiguous state: tensors that grow by concatenation. Simple; the paged state's oracle."""

    num_tokens: int
    layers: list[LayerState]
    window_size: int = 128
    recent_ids: list[int] = field(default_factory=list)  # the last `config.engram_context` token ids (V4.1)
    trim_from: int = 0  # a contiguous state never runs a trimmed replay (engine.kv.PagedState does)
    decode_view_type: ClassVar[type | None] = None  # decodes one sequence at a time

    @classmethod
    def empty(cls, config: CacheSpec, device=None, dtype: torch.dtype = torch.float32) -> "SequenceState":
        layers = [_empty_layer(config, i, device, dtype) for i in range(config.num_layers)]
        return cls(num_tokens=0, layers=layers, window_size=config.sliding_window)

    def clone(self) -> "SequenceState":
        layers = [layer.clone() for layer in self.layers]
        return SequenceState(self.num_tokens, layers, self.window_size, list(self.recent_ids))

    def window(self, layer: int, position: int) -> torch.Tensor:
        return self.layers[layer].window

    def append_window(self, layer: int, kv: torch.Tensor, position: int) -> None:
        state = self.layers[layer]
        state.window = torch.cat([state.window, kv])[-self.window_size :].clone()

    def entries(self, layer: int, count: int) -> torch.Tensor:
        return self.layers[layer].entries[:count]

    def write_entries(self, layer: int, first: int, new: torch.Tensor) -> None:
        state = self.layers[layer]
        state.entries = torch.cat([state.entries[:first], new])

    def index_keys(self, layer: int, count: int) -> torch.Tensor:
        return self.layers[layer].index_keys[:count]

    def write_index_keys(self, layer: int, first: int, new: torch.Tensor) -> None:
        state = self.layers[layer]
        state.index_keys = torch.cat([state.index_keys[:first], new])

    def tail(self, layer: int, position: int, indexer: bool = False) -> PoolerTail | None:
        state = self.layers[layer]
        return state.index_tail if indexer else state.tail

    def set_tail(self, layer: int, position: int, tail: PoolerTail, indexer: bool = False) -> None:
        if indexer:
            self.layers[layer].index_tail = tail
        else:
            self.layers[layer].tail = tail

    def capture(self, layer: int, position: int) -> None:
        raise NotImplementedError("the contiguous state keeps no boundary captures; use engine.kv.PagedState")


@dataclass(slots=True)
class BlockKV:
    """Compressed entries of one page of `block_size` tokens, per layer (None for sliding layers)."""

    entries: list[torch.Tensor | None]
    index_keys: list[torch.Tensor | None]


@dataclass(slots=True)
class StateParts:
    num_tokens: int
    blocks: list[BlockKV]
    windows: list[torch.Tensor]
    tails: list[PoolerTail | None] = field(default_factory=list)
    index_tails: list[PoolerTail | None] = field(default_factory=list)
    recent_ids: list[int] = field(default_factory=list)


def split_state(state: SequenceState, config: CacheSpec, block_size: int = 128) -> StateParts:
    """Cut a state whose length is a multiple of `block_size` into pages + windows + tails (copies)."""
    if state.num_tokens % block_size:
        raise ValueError(f"{state.num_tokens} tokens is not a multiple of the block size {block_size}")
    blocks = []
    for block in range(state.num_tokens // block_size):
        entries, index_keys = [], []
        for i, layer in enumerate(state.layers):
            ratio = config.compress_ratio(i)
            if ratio == 0:
                entries.append(None)
                index_keys.append(None)
                continue
            if block_size % ratio:
                raise ValueError(f"block size {block_size} is not a multiple of ratio {ratio}")
            rows = slice(block * block_size // ratio, (block + 1) * block_size // ratio)
            entries.append(layer.entries[rows].clone())
            index_keys.append(None if layer.index_keys is None else layer.index_keys[rows].clone())
        blocks.append(BlockKV(entries, index_keys))
    return StateParts(
        num_tokens=state.num_tokens,
        blocks=blocks,
        windows=[layer.window.clone() for layer in state.layers],
        tails=[None if layer.tail is None else layer.tail.clone() for layer in state.layers],
        index_tails=[None if layer.index_tail is None else layer.index_tail.clone() for layer in state.layers],
        recent_ids=list(state.recent_ids),
    )


def join_state(parts: StateParts, config: CacheSpec) -> SequenceState:
    """Rebuild a fresh state from pages + SWA windows + tails."""
    layers = []
    for i in range(config.num_layers):
        layer = LayerState(window=parts.windows[i].clone())
        if config.compress_ratio(i):
            layer.entries = torch.cat([block.entries[i] for block in parts.blocks])
            layer.tail = parts.tails[i].clone()
        if config.owns_index_keys(i):
            layer.index_keys = torch.cat([block.index_keys[i] for block in parts.blocks])
        if config.has_index_tail(i):
            layer.index_tail = parts.index_tails[i].clone()
        layers.append(layer)
    expected = [config.compress_ratio(i) and parts.num_tokens // config.compress_ratio(i) for i in range(len(layers))]
    for i, (layer, count) in enumerate(zip(layers, expected)):
        if layer.entries is not None and layer.entries.shape[0] != count:
            raise ValueError(f"layer {i}: {layer.entries.shape[0]} entries for {parts.num_tokens} tokens")
    return SequenceState(parts.num_tokens, layers, config.sliding_window, list(parts.recent_ids))


def state_nbytes(state: SequenceState) -> dict[str, int]:
    """Bytes held per kind of state (block KV, SWA window, tails)."""
    sizes = {"block": 0, "window": 0, "tails": 0}
    for layer in state.layers:
        sizes["window"] += _nbytes(layer.window)
        sizes["block"] += _nbytes(layer.entries) + _nbytes(layer.index_keys)
        for tail in (layer.tail, layer.index_tail):
            if tail is not None:
                sizes["tails"] += sum(_nbytes(t) for t in tail_tensors(tail))
    return sizes


def _empty_layer(config: CacheSpec, layer: int, device, dtype) -> LayerState:
    window = torch.empty(0, config.head_dim, device=device, dtype=dtype)
    if config.compress_ratio(layer) == 0:
        return LayerState(window=window)
    state = LayerState(
        window=window,
        entries=torch.empty(0, config.head_dim, device=device, dtype=dtype),
        tail=empty_tail(config.head_dim, config.overlapping_tail(layer), device, dtype),
    )
    if config.owns_index_keys(layer):
        state.index_keys = torch.empty(0, config.index_head_dim, device=device, dtype=dtype)
    if config.has_index_tail(layer):
        state.index_tail = empty_tail(config.index_head_dim, True, device, dtype)
    return state


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()
