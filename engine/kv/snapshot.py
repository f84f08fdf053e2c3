"""A sequence's state <-> (KVSnapshot header, buffers) for the wire.

Buffers (contiguous CPU tensors, in this order): PAGES [n, page_numel] for the n = ceil(num_tokens
/ block_size) pages the state touches, SWA [num_layers, min(num_tokens, window), head_dim], TAILS
(flat, engine.kv.tails layout). At a block boundary the last page is full and the tails hold only
the CSA overlaps; elsewhere the last page is partial and the tails hold pending tokens too.

A boundary state alone (window + tails saved at a block boundary, served to a peer that loads the
pages from the KV store) travels as a header with roles [SWA, TAILS], num_tokens = the boundary and
block_hashes = the chain's hashes up to it (at least the last one: the block ending there), and
those two buffers.
"""

from __future__ import annotations

import torch

from engine.kv.manager import KVCache, Restored
from engine.kv.swa import BoundaryState
from engine.kv.tails import tails_numel
from messages.handoff import KV_LAYOUT_VERSION, BufferRole, KVSnapshot

ROLES = [BufferRole.PAGES, BufferRole.SWA, BufferRole.TAILS]
BOUNDARY_ROLES = [BufferRole.SWA, BufferRole.TAILS]


def make_snapshot(kv: KVCache, seq) -> tuple[KVSnapshot, list[torch.Tensor]]:
    state = seq.state
    if state is None or state.num_tokens != seq.num_computed:
        raise ValueError(f"request {seq.request_id} has no computed state to snapshot (waiting or preempted)")
    num_tokens, block_size = state.num_tokens, kv.block_size
    pages = kv.read_pages(seq, -(-num_tokens // block_size)).contiguous()
    boundary = state.boundary_state()
    header = KVSnapshot(
        model_id=seq.model_id, layout_version=KV_LAYOUT_VERSION, block_size=block_size, num_tokens=num_tokens,
        block_hashes=list(seq.block_hashes[: num_tokens // block_size]), roles=[int(r) for r in ROLES],
        num_cached_tokens=seq.num_cached_tokens,
        window_cacheable=not (state.trim_end and num_tokens <= state.trim_end))
    return header, [pages, boundary.windows.cpu().contiguous(), boundary.tails.cpu().contiguous()]


def parse_snapshot(kv: KVCache, model_id: str, snapshot: KVSnapshot, buffers, block_hashes: list[bytes]) -> Restored:
    """Check a received snapshot against this engine and the request's own hash chain."""
    config, layout = kv.config, kv.layout
    if snapshot.model_id != model_id:
        raise ValueError(f"snapshot is of model {snapshot.model_id!r}, this engine serves {model_id!r}")
    if snapshot.layout_version != KV_LAYOUT_VERSION or snapshot.block_size != kv.block_size:
        raise ValueError(f"snapshot layout v{snapshot.layout_version} / block {snapshot.block_size} "
                         f"!= v{KV_LAYOUT_VERSION} / block {kv.block_size}")
    if list(snapshot.roles) != [int(r) for r in ROLES] or len(buffers) != len(ROLES):
        raise ValueError(f"snapshot buffers have roles {snapshot.roles} ({len(buffers)} buffers), expected {ROLES}")
    num_tokens = snapshot.num_tokens
    full = num_tokens // kv.block_size
    if num_tokens <= 0 or list(snapshot.block_hashes) != block_hashes[:full] or len(snapshot.block_hashes) != full:
        raise ValueError("snapshot's block hashes do not match the request's tokens")
    pages, windows, tails = (torch.as_tensor(b) for b in buffers)
    dtype = kv.pool.pages.dtype
    expect = {
        "pages": ((-(-num_tokens // kv.block_size), layout.page_numel), pages),
        "window": ((config.num_layers, min(num_tokens, config.sliding_window), config.head_dim), windows),
        "tails": ((tails_numel(config, num_tokens),), tails.reshape(-1)),
    }
    for name, (shape, tensor) in expect.items():
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"snapshot {name} buffer is {tensor.dtype}{list(tensor.shape)}, "
                             f"expected {dtype}{list(shape)}")
    return Restored(pages, BoundaryState(num_tokens, windows, tails.reshape(-1)), snapshot.window_cacheable)


def make_boundary_snapshot(kv: KVCache, model_id: str, block_hash: bytes,
                           state: BoundaryState) -> tuple[KVSnapshot, list[torch.Tensor]]:
    """A saved boundary state as (header, [window, tails]) copies on the CPU."""
    header = KVSnapshot(
        model_id=model_id, layout_version=KV_LAYOUT_VERSION, block_size=kv.block_size,
        num_tokens=state.num_tokens, block_hashes=[block_hash], roles=[int(r) for r in BOUNDARY_ROLES])
    return header, [state.windows.cpu().contiguous().clone(), state.tails.cpu().reshape(-1).contiguous().clone()]


def parse_boundary_snapshot(kv: KVCache, model_id: str, snapshot: KVSnapshot, buffers,
                            block_hashes: list[bytes]) -> BoundaryState:
    """Check a received boundary state against this engine and the chain it belongs to (it must
    end at one of the chain's block boundaries); returns an owned CPU copy."""
    config, block_size = kv.config, kv.block_size
    if snapshot.model_id != model_id:
        raise ValueError(f"boundary state is of model {snapshot.model_id!r}, this engine serves {model_id!r}")
    if snapshot.layout_version != KV_LAYOUT_VERSION or snapshot.block_size != block_size:
        raise ValueError(f"boundary state layout v{snapshot.layout_version} / block {snapshot.block_size} "
                         f"!= v{KV_LAYOUT_VERSION} / block {block_size}")
    buffers = list(buffers)
    if list(snapshot.roles) != [int(r) for r in BOUNDARY_ROLES] or len(buffers) != len(BOUNDARY_ROLES):
        raise ValueError(f"boundary state buffers have roles {snapshot.roles} ({len(buffers)} buffers), "
                         f"expected {BOUNDARY_ROLES}")
    num_tokens = snapshot.num_tokens
    if num_tokens <= 0 or num_tokens % block_size:
        raise ValueError(f"boundary state covers {num_tokens} tokens, not a positive multiple of {block_size}")
    end, given = num_tokens // block_size, list(snapshot.block_hashes)
    if end > len(block_hashes) or not given or len(given) > end or given != block_hashes[end - len(given) : end]:
        raise ValueError(f"boundary state at {num_tokens} tokens does not match the imported chain's block hashes")
    windows, tails = (torch.as_tensor(b) for b in buffers)
    dtype = kv.pool.pages.dtype
    expect = {
        "window": ((config.num_layers, min(num_tokens, config.sliding_window), config.head_dim), windows),
        "tails": ((tails_numel(config, num_tokens),), tails.reshape(-1)),
    }
    for name, (shape, tensor) in expect.items():
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"boundary state {name} buffer is {tensor.dtype}{list(tensor.shape)}, "
                             f"expected {dtype}{list(shape)}")
    host = torch.device("cpu")
    return BoundaryState(num_tokens, windows.to(host, copy=True).contiguous(),
                         tails.reshape(-1).to(host, copy=True).contiguous())
