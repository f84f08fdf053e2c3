"""A writer process for the crash test: writes chains of pages as fast as it can until killed.

`python -m tests.kvstore.crash_writer ROOT FIRST_CHAIN FSYNC` writes chain FIRST_CHAIN,
FIRST_CHAIN+1, ... (CHAIN_BLOCKS blocks each, pages from `crash_page`), printing "wrote <chain>"
after each write call returns. Pages are cheap to make so that the process spends its time writing.
"""
from __future__ import annotations

import sys

from kvstore import SegmentStore, StoreSettings
from messages.tensors import TensorDesc
from tests.kvstore.common import chain, page_for

CHAIN_BLOCKS = 8
PAGE_TILES = 128             # a page = a 4 KiB random tile (from its hash) repeated: 512 KiB
SEGMENT_BYTES = 8 << 20


def crash_page(key: bytes) -> tuple[TensorDesc, memoryview]:
    desc, tile = page_for(key)
    return TensorDesc(desc.dtype, (desc.shape[0] * PAGE_TILES,)), memoryview(bytes(tile) * PAGE_TILES)


def main(root: str, first: int, fsync: str) -> None:
    store = SegmentStore(StoreSettings(root=root, segment_bytes=SEGMENT_BYTES, fsync=fsync))
    n = first
    while True:
        keys = chain(CHAIN_BLOCKS, seed=n)
        store.write([(k, crash_page(k)) for k in keys])
        print(f"wrote {n}", flush=True)
        n += 1


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
