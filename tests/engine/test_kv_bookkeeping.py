"""Page bookkeeping (no model involved); the hash chain itself is tested in tests/messages/test_prefix.py."""

from __future__ import annotations

import pytest

from engine.kv.block_manager import BlockManager


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
