"""The prefix hash chain and page bookkeeping (no model involved)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.kv.block_manager import BlockManager
from engine.kv.prefix_hash import HASH_BYTES, block_hashes, chain_hash


def test_one_hash_per_full_block_each_covering_everything_before_it():
    tokens = list(range(300))
    hashes = block_hashes("m", tokens)
    assert len(hashes) == 2 and all(len(h) == HASH_BYTES for h in hashes)
    assert hashes[1] == chain_hash(hashes[0], "m", tokens[128:256])
    changed_first = block_hashes("m", [999] + tokens[1:])
    assert changed_first[0] != hashes[0] and changed_first[1] != hashes[1]
    assert block_hashes("other-model", tokens) != hashes
    assert block_hashes("m", tokens[:256]) == hashes  # the partial third block is not hashed
    assert block_hashes("m", tokens + list(range(100)), previous=hashes) == block_hashes("m", tokens + list(range(100)))


def test_hash_is_fixed_by_its_definition():
    """blake2b-128 over (len(prev), prev, len(model id) u32 LE, model id, tokens as int32 LE)."""
    import hashlib
    import struct

    tokens = list(range(128))
    expected = hashlib.blake2b(b"\x00" + struct.pack("<I", 3) + b"abc" + struct.pack("<128i", *tokens), digest_size=16)
    assert block_hashes("abc", tokens) == [expected.digest()]
    with pytest.raises(ValueError, match="int32"):
        chain_hash(b"", "m", [2**31])


def test_prefix_hash_imports_without_torch():
    code = "import sys, engine.kv.prefix_hash; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pages_are_reference_counted_and_cached_when_freed():
    blocks = BlockManager(4)
    a = blocks.allocate(2)
    assert blocks.register(a[0], b"h0") and blocks.num_used == 2
    blocks.deallocate(a)
    assert (blocks.num_free, blocks.num_cached, blocks.num_used) == (3, 1, 0)
    assert blocks.lookup([b"h0", b"h1"]) == [a[0]]
    assert blocks.cost_to_share([a[0]]) == 1
    blocks.share([a[0]])
    blocks.share([a[0]])
    assert blocks.ref_counts[a[0]] == 2 and blocks.num_cached == 0
    blocks.deallocate([a[0]])
    blocks.deallocate([a[0]])
    with pytest.raises(ValueError, match="freed more often"):
        blocks.deallocate([a[0]])


def test_allocation_takes_free_pages_before_evicting_the_least_recently_freed_cached_page():
    blocks = BlockManager(3)
    pages = blocks.allocate(3)
    for i, page in enumerate(pages):
        blocks.register(page, bytes([i]))
    blocks.deallocate([pages[1]])
    blocks.deallocate([pages[0]])
    blocks.deallocate([pages[2]])
    assert blocks.num_free == 0 and blocks.can_allocate(3) and not blocks.can_allocate(4)
    assert blocks.allocate(1) == [pages[1]]  # freed first, evicted first
    assert blocks.lookup([bytes([1])]) == [] and blocks.lookup([bytes([0])]) == [pages[0]]
    with pytest.raises(MemoryError):
        blocks.allocate(3)


def test_a_block_computed_twice_stays_indexed_once():
    blocks = BlockManager(2)
    first, second = blocks.allocate(2)
    assert blocks.register(first, b"same")
    assert not blocks.register(second, b"same")  # a private duplicate: freed, not cached
    blocks.deallocate([first, second])
    assert (blocks.num_free, blocks.num_cached) == (1, 1)
