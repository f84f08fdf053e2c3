"""Compressor tails: `TailRings` keeps them for running sequences; the flat form travels.

Flat: compressor tails <-> one flat tensor, in a layout fixed by the model config and the token count.

Order: for each compressed layer, its compressor tail, then (compressed-sparse layers) its
indexer tail. Each tail is pending_kv [p, width], pending_gate [p, width], then, once the first
window has completed (num_tokens >= ratio) on overlapping (CSA) tails, overlap_kv [ratio, d] and
overlap_gate [ratio, d]. p = num_tokens % ratio, so at a 128-token boundary only overlaps remain.
"""

from __future__ import annotations

import torch

from engine.models.common.tail import PoolerTail, empty_tail
from engine.models.spec import CacheSpec

Tails = list[tuple[PoolerTail | None, PoolerTail | None]]  # per layer: (compressor tail, indexer tail)


def tail_shapes(config: CacheSpec, num_tokens: int) -> list[tuple[int, int, int, bool]]:
    """Per tail in order: (layer, ratio, head_dim, is_indexer)."""
    shapes = []
    for layer in range(config.num_layers):
        ratio = config.compress_ratio(layer)
        if ratio:
            shapes.append((layer, ratio, config.head_dim, False))
        if config.has_index_tail(layer):
            shapes.append((layer, ratio, config.index_head_dim, True))
    return shapes


def _parts(config: CacheSpec, layer: int, ratio: int, dim: int, num_tokens: int) -> list[tuple[int, int]]:
    overlap = config.overlapping_tail(layer)
    width, pending = (2 * dim if overlap else dim), num_tokens % ratio
    parts = [(pending, width), (pending, width)]
    if overlap and num_tokens >= ratio:
        parts += [(ratio, dim), (ratio, dim)]
    return parts


def tails_numel(config: CacheSpec, num_tokens: int) -> int:
    return sum(rows * width for layer, ratio, dim, _ in tail_shapes(config, num_tokens)
               for rows, width in _parts(config, layer, ratio, dim, num_tokens))


def pack_tails(tails: Tails, config: CacheSpec, num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """One contiguous 1-D tensor holding every tail (checked against the expected shapes)."""
    pieces = []
    for layer, ratio, dim, is_indexer in tail_shapes(config, num_tokens):
        tail = tails[layer][1 if is_indexer else 0]
        tensors = [tail.pending_kv, tail.pending_gate, tail.overlap_kv, tail.overlap_gate]
        for tensor, shape in zip(tensors, _parts(config, layer, ratio, dim, num_tokens)):
            if tensor is None or tuple(tensor.shape) != shape:
                found = None if tensor is None else tuple(tensor.shape)
                raise ValueError(f"layer {layer} tail has {found}, not {shape}")
            pieces.append(tensor.reshape(-1))
    if not pieces:
        return torch.empty(0, dtype=dtype)
    return torch.cat(pieces)


def unpack_tails(flat: torch.Tensor, config: CacheSpec, num_tokens: int, device, dtype: torch.dtype) -> Tails:
    """Rebuild the per-layer tails (fresh tensors on `device`) from `pack_tails` output."""
    tails: Tails = [(None, None) for _ in range(config.num_layers)]
    flat = flat.reshape(-1)
    offset = 0
    for layer, ratio, dim, is_indexer in tail_shapes(config, num_tokens):
        tensors = []
        for rows, width in _parts(config, layer, ratio, dim, num_tokens):
            size = rows * width
            if offset + size > flat.numel():
                raise ValueError(f"tail buffer of {flat.numel()} elements is too short for {num_tokens} tokens")
            tensors.append(flat[offset : offset + size].view(rows, width).to(device=device, dtype=dtype, copy=True))
            offset += size
        overlap = config.overlapping_tail(layer)
        tail = empty_tail(dim, overlap, device, dtype)
        tail.pending_kv, tail.pending_gate = tensors[0], tensors[1]
        if len(tensors) == 4:
            tail.overlap_kv, tail.overlap_gate = tensors[2], tensors[3]
        compressor, indexer = tails[layer]
        tails[layer] = (compressor, tail) if is_indexer else (tail, indexer)
    if offset != flat.numel():
        raise ValueError(f"tail buffer has {flat.numel()} elements, {num_tokens} tokens need {offset}")
    return tails


def clone_tails(tails: Tails) -> Tails:
    return [(None if a is None else a.clone(), None if b is None else b.clone()) for a, b in tails]


class TailRings:
    """The compressor tails of running sequences, preallocated per slot (like `SwaSlots`).

    Each tail is a ring of the projected kv and raw gate of a sequence's last `span` tokens, token
    p in row p % span: span = ratio for HCA; 2 * ratio for the overlapping CSA tails, whose previous
    window (its first, "Ca" half is the overlap) sits in the other half of the ring. A decode step
    then appends one row per tail and finds any window it completes in place, for a whole batch at
    once; `read` / `write` convert to and from the `PoolerTail` form (pending + overlap) that the
    prefill path and the flat wire layout use. Rows of positions older than the tail are stale.
    """

    def __init__(self, config: CacheSpec, num_slots: int, device, dtype: torch.dtype):
        self.kv: dict[tuple[int, bool], torch.Tensor] = {}  # (layer, is_indexer) -> [slots + 1, span, width]
        self.gate: dict[tuple[int, bool], torch.Tensor] = {}
        self.shape: dict[tuple[int, bool], tuple[int, int, bool]] = {}  # -> (ratio, head_dim, overlap)
        for layer, ratio, dim, is_indexer in tail_shapes(config, 0):
            overlap = config.overlapping_tail(layer)
            span, width = (2 * ratio, 2 * dim) if overlap else (ratio, dim)
            key = (layer, is_indexer)
            self.kv[key] = torch.zeros(num_slots + 1, span, width, device=device, dtype=dtype)  # + SwaSlots.scratch
            self.gate[key] = torch.zeros(num_slots + 1, span, width, device=device, dtype=dtype)
            self.shape[key] = (ratio, dim, overlap)

    def span(self, key: tuple[int, bool]) -> int:
        return self.kv[key].shape[1]

    def _rows(self, key, start: int, end: int) -> torch.Tensor:
        return torch.arange(start, end, device=self.kv[key].device) % self.span(key)

    def read(self, slot: int, key: tuple[int, bool], position: int) -> PoolerTail:
        """The tail after `position` tokens: pending tokens, and the overlap once a window is done."""
        ratio, dim, overlap = self.shape[key]
        first_pending = position - position % ratio
        rows = self._rows(key, first_pending, position)
        kv, gate = self.kv[key][slot], self.gate[key][slot]
        tail = PoolerTail(pending_kv=kv[rows], pending_gate=gate[rows])
        if overlap and position >= ratio:
            rows = self._rows(key, first_pending - ratio, first_pending)
            tail.overlap_kv, tail.overlap_gate = kv[rows, :dim], gate[rows, :dim]
        return tail

    def write(self, slot: int, key: tuple[int, bool], position: int, tail: PoolerTail) -> None:
        """Store the tail as it stands after `position` tokens (the inverse of `read`)."""
        ratio, dim, _ = self.shape[key]
        pending = tail.pending_kv.shape[0]
        if pending != position % ratio:
            raise ValueError(f"a tail after {position} tokens holds {position % ratio} pending, not {pending}")
        kv, gate = self.kv[key][slot], self.gate[key][slot]
        if pending:
            rows = self._rows(key, position - pending, position)
            kv.index_copy_(0, rows, tail.pending_kv.to(kv.dtype))
            gate.index_copy_(0, rows, tail.pending_gate.to(gate.dtype))
        if tail.overlap_kv is not None:
            rows = self._rows(key, position - pending - ratio, position - pending)
            kv[:, :dim].index_copy_(0, rows, tail.overlap_kv.to(kv.dtype))
            gate[:, :dim].index_copy_(0, rows, tail.overlap_gate.to(gate.dtype))
