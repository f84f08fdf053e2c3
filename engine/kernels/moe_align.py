"""Expert-sorted, block-padded token slots for the mixture-of-experts kernels, and their tile sizes.

A token's k routing choices are its slots (slot s = token * k + j). The grouped kernels process
blocks of BLOCK_M rows that all belong to one expert, so the slots are sorted by expert (stably:
ties keep slot order) and each expert's run is padded up to a multiple of BLOCK_M with the
sentinel n_slots. Everything stays on the device with shapes fixed by (T, k, E, BLOCK_M): no
host sync, so a decode step can be captured in a CUDA graph. The grid is sized by the bound
  blocks <= floor(T*k / BLOCK_M) + min(E, T*k)
(each non-empty expert wastes at most one partial block); programs past the blocks in use read
`rows_used` and return at once, and experts without tokens get no block at all.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.kernels import quant_linear
from engine.kernels.quant_linear import k_tile
from engine.quant.packed import Packed


class SlotBlocks(NamedTuple):
    sorted_slots: torch.Tensor  # int32 [max_blocks * block_m]: the slot of each padded row, n_slots for padding
    block_expert: torch.Tensor  # int32 [max_blocks]: the expert of each block (a real one past the end too)
    rows_used: torch.Tensor  # int64 [1]: padded rows in use, a multiple of block_m
    max_blocks: int  # the grid's row-block count (a bound from shapes alone)
    block_m: int


def max_row_blocks(n_slots: int, n_experts: int, block_m: int) -> int:
    return n_slots // block_m + min(n_experts, n_slots)


def align_slots(route_experts: torch.Tensor, n_experts: int, block_m: int) -> SlotBlocks:
    """Sort a [T, k] expert choice by expert and pad every expert's run to block_m rows (torch ops only)."""
    flat = route_experts.reshape(-1)
    n_slots, device = flat.numel(), flat.device
    max_blocks = max_row_blocks(n_slots, n_experts, block_m)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    # per-expert ends by binary search (bincount would read the max on the host: a sync)
    ends = torch.searchsorted(sorted_experts, torch.arange(n_experts, device=device, dtype=flat.dtype), right=True)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, dim=0)
    # row of sorted position i: its expert's padded start + its rank within the expert
    rank = torch.arange(n_slots, device=device) - (ends - counts)[sorted_experts]
    rows = (padded_ends - padded)[sorted_experts] + rank
    sorted_slots = torch.full((max_blocks * block_m,), n_slots, dtype=torch.int32, device=device)
    sorted_slots[rows] = order.to(torch.int32)
    block_starts = torch.arange(max_blocks, device=device, dtype=padded_ends.dtype) * block_m
    block_expert = torch.searchsorted(padded_ends, block_starts, right=True).clamp_(max=n_experts - 1)
    return SlotBlocks(sorted_slots, block_expert.to(torch.int32), padded_ends[-1:], max_blocks, block_m)


class MoeTiles(NamedTuple):
    block_m: int
    gate_up_n: int
    gate_up_k: int
    down_n: int
    down_k: int
    num_warps: int
    num_stages: int
    swap: bool  # weight x activation^T on the MMA (quant_linear.SWAP_AB)


DECODE_SLOTS = 1024  # up to this many token slots, decode tiles


def moe_tiles(n_slots: int, gate_up: Packed, down: Packed) -> MoeTiles:
    """Decode (few slots) is memory bound: 16-row blocks and narrow N tiles put many programs on the
    weight stream, each reading long K runs. Prefill is compute bound: wide MMA tiles."""
    if n_slots <= DECODE_SLOTS:
        n_tile = 32 if n_slots <= 48 else 64  # few experts in use: narrower tiles, more programs (H200: -10% at T=1)
        return MoeTiles(16, n_tile, k_tile(gate_up, 128), n_tile, k_tile(down, 128), 4, 4, quant_linear.SWAP_AB)
    return MoeTiles(64, 128, k_tile(gate_up, 64), 128, k_tile(down, 64), 8, 3, False)
