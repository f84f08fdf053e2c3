"""Page bookkeeping: reference counts, the free list, and the prefix index (block hash -> page).

A page holds one block (128 tokens) of block KV for every layer. Pages a request references have
ref_count > 0. A page whose count drops to 0 stays in the prefix index if it holds a full block
with a known hash ("cached": evictable, least recently freed first); otherwise it is free.
Allocation takes free pages first, then evicts cached ones. No tensors here: see page_pool.py.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence


class BlockManager:
    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self.ref_counts = [0] * num_pages
        self.page_hash: list[bytes | None] = [None] * num_pages
        self.hash_to_page: dict[bytes, int] = {}
        self.free: deque[int] = deque(range(num_pages))
        self.cached: OrderedDict[int, None] = OrderedDict()  # ref 0, still indexed; oldest first
        self.evicted: list[bytes] = []  # hashes dropped from the index since the owner last drained it

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self.free) - len(self.cached)

    def can_allocate(self, count: int) -> bool:
        return count <= len(self.free) + len(self.cached)

    def allocate(self, count: int) -> list[int]:
        """`count` pages with ref_count 1; evicts the least recently freed cached pages if needed."""
        if not self.can_allocate(count):
            raise MemoryError(f"{count} pages asked, {len(self.free) + len(self.cached)} available")
        pages = []
        for _ in range(count):
            if self.free:
                page = self.free.popleft()
            else:
                page, _ = self.cached.popitem(last=False)
                del self.hash_to_page[self.page_hash[page]]
                self.evicted.append(self.page_hash[page])
                self.page_hash[page] = None
            self.ref_counts[page] = 1
            pages.append(page)
        return pages

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """Pages of the longest prefix of `hashes` held in the index."""
        pages = []
        for h in hashes:
            page = self.hash_to_page.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def cost_to_share(self, pages: Iterable[int]) -> int:
        """How many allocatable pages sharing `pages` uses up (the cached ones among them)."""
        return sum(1 for p in pages if self.ref_counts[p] == 0)

    def share(self, pages: Iterable[int]) -> None:
        for page in pages:
            if self.ref_counts[page] == 0:
                if page not in self.cached:
                    raise ValueError(f"page {page} is free, not cached: nothing to share")
                del self.cached[page]
            self.ref_counts[page] += 1

    def deallocate(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page. Freed last-to-first, so a sequence's tail blocks are
        evicted before its head blocks (heads are the more widely shared prefixes)."""
        for page in reversed(pages):
            if self.ref_counts[page] <= 0:
                raise ValueError(f"page {page} freed more often than referenced")
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                if self.page_hash[page] is None:
                    self.free.append(page)
                else:
                    self.cached[page] = None

    def register(self, page: int, block_hash: bytes) -> bool:
        """Index a referenced page holding the full block `block_hash`. False if another page
        already holds that block (this page then stays private and is freed normally)."""
        if self.ref_counts[page] <= 0:
            raise ValueError(f"page {page} is not referenced")
        if block_hash in self.hash_to_page or self.page_hash[page] is not None:
            return self.hash_to_page.get(block_hash) == page
        self.hash_to_page[block_hash] = page
        self.page_hash[page] = block_hash
        return True
