"""Compressor tails <-> one flat tensor, in a layout fixed by the model config and the token count.

Order: for each compressed layer, its compressor tail, then (compressed-sparse layers) its
indexer tail. Each tail is pending_kv [p, width], pending_gate [p, width], then, once the first
window has completed (num_tokens >= ratio) on overlapping (CSA) tails, overlap_kv [ratio, d] and
overlap_gate [ratio, d]. p = num_tokens % ratio, so at a 128-token boundary only overlaps remain.
"""

from __future__ import annotations

import torch

from engine.model.config import CSA, ModelConfig
from engine.model.state import PoolerTail, empty_tail

Tails = list[tuple[PoolerTail | None, PoolerTail | None]]  # per layer: (compressor tail, indexer tail)


def tail_shapes(config: ModelConfig, num_tokens: int) -> list[tuple[int, int, int, bool]]:
    """Per tail in order: (layer, ratio, head_dim, is_indexer)."""
    shapes = []
    for layer in range(config.num_layers):
        ratio = config.compress_ratio(layer)
        if ratio:
            shapes.append((layer, ratio, config.head_dim, False))
        if config.layer_types[layer] == CSA:
            shapes.append((layer, ratio, config.index_head_dim, True))
    return shapes


def _parts(config: ModelConfig, layer: int, ratio: int, dim: int, num_tokens: int) -> list[tuple[int, int]]:
    overlap = config.layer_types[layer] == CSA
    width, pending = (2 * dim if overlap else dim), num_tokens % ratio
    parts = [(pending, width), (pending, width)]
    if overlap and num_tokens >= ratio:
        parts += [(ratio, dim), (ratio, dim)]
    return parts


def tails_numel(config: ModelConfig, num_tokens: int) -> int:
    return sum(rows * width for layer, ratio, dim, _ in tail_shapes(config, num_tokens)
               for rows, width in _parts(config, layer, ratio, dim, num_tokens))


def pack_tails(tails: Tails, config: ModelConfig, num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
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


def unpack_tails(flat: torch.Tensor, config: ModelConfig, num_tokens: int, device, dtype: torch.dtype) -> Tails:
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
        overlap = config.layer_types[layer] == CSA
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
