"""SwaRegistry: which worker holds the sliding-window state for which prefix block, for a while.

Pure and synchronous, with an injectable clock (pass `now`, or leave it out and the registry asks
its `clock`). Each entry maps a prefix hash to one holder address and an expiry time. Expired
entries are misses at once and are removed by `expire()`, which pops a min-heap keyed by expiry
time, so each call costs only the entries it removes. Replaced or removed entries leave stale heap
items behind; they are skipped on pop and the heap is rebuilt when they outnumber the live ones.

Bounded: at most `max_entries` entries (when full, the entries closest to expiry are evicted and
counted), TTLs clamped to `max_ttl_s`, at most `max_hashes_per_message` hashes per call, hashes of
1..64 bytes. Bad input raises InvalidRequest before anything changes.
"""
from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from messages.errors import InvalidRequest

MAX_HASH_BYTES = 64
MAX_HOLDER_CHARS = 256
_COMPACT_SLACK = 1024     # stale heap items tolerated beyond the live entries before a rebuild


@dataclass(slots=True, frozen=True)
class RegistryLimits:
    default_ttl_s: float = 180.0          # seeds: SWA state TTL ~180 s, hit rate > 98%
    max_ttl_s: float = 600.0
    max_entries: int = 1_000_000
    max_hashes_per_message: int = 4096

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_ttl_s) and self.max_ttl_s > 0):
            raise ValueError("max_ttl_s must be a positive finite number")
        if not (math.isfinite(self.default_ttl_s) and 0 < self.default_ttl_s <= self.max_ttl_s):
            raise ValueError("default_ttl_s must be in (0, max_ttl_s]")
        if self.max_entries < 1 or self.max_hashes_per_message < 1:
            raise ValueError("max_entries and max_hashes_per_message must be >= 1")


@dataclass(slots=True)
class RegistryStats:
    """Cumulative counts since start; `lookups` counts hashes asked, so hits + misses == lookups."""
    registrations: int = 0
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    expirations: int = 0
    unregistrations: int = 0
    dropped: int = 0          # removed because their holder died


class _Entry:
    __slots__ = ("holder", "expires_at", "seq")

    def __init__(self, holder: str, expires_at: float, seq: int):
        self.holder = holder
        self.expires_at = expires_at
        self.seq = seq            # matches exactly one heap item; older items for this hash are stale


class SwaRegistry:
    def __init__(self, limits: RegistryLimits | None = None, clock: Callable[[], float] = time.monotonic):
        self.limits = limits or RegistryLimits()
        self.clock = clock
        self.stats = RegistryStats()
        self._entries: dict[bytes, _Entry] = {}
        self._by_holder: dict[str, set[bytes]] = {}
        self._heap: list[tuple[float, int, bytes]] = []    # (expires_at, seq, hash)
        self._seq = 0

    def __len__(self) -> int:
        return len(self._entries)

    # ---- operations --------------------------------------------------------------------
    def register(self, prefix_hashes: Sequence[bytes], holder: str, ttl_s: float | None = None,
                 now: float | None = None) -> int:
        """Record `holder` for every hash (latest holder wins, its TTL restarts); returns the count."""
        self._check_hashes(prefix_hashes)
        if not isinstance(holder, str) or not 0 < len(holder) <= MAX_HOLDER_CHARS:
            raise InvalidRequest(f"holder must be a non-empty address of at most {MAX_HOLDER_CHARS} chars")
        ttl = self._clamp_ttl(ttl_s)
        now = self.clock() if now is None else now
        expires_at = now + ttl
        for h in prefix_hashes:
            entry = self._entries.get(h)
            if entry is not None:
                self._unindex(h, entry.holder)
            else:
                if len(self._entries) >= self.limits.max_entries:
                    self.expire(now)
                while len(self._entries) >= self.limits.max_entries:
                    self._evict_one()
            self._seq += 1
            self._entries[h] = _Entry(holder, expires_at, self._seq)
            self._by_holder.setdefault(holder, set()).add(h)
            heapq.heappush(self._heap, (expires_at, self._seq, h))
        self.stats.registrations += len(prefix_hashes)
        self._maybe_compact()
        return len(prefix_hashes)

    def lookup(self, prefix_hashes: Sequence[bytes], now: float | None = None) -> list[str]:
        """The holder of each hash, or "" where none is registered or its entry expired."""
        self._check_hashes(prefix_hashes)
        now = self.clock() if now is None else now
        holders = []
        for h in prefix_hashes:
            entry = self._entries.get(h)
            holders.append(entry.holder if entry is not None and entry.expires_at > now else "")
        hits = sum(1 for holder in holders if holder)
        self.stats.lookups += len(holders)
        self.stats.hits += hits
        self.stats.misses += len(holders) - hits
        return holders

    def unregister(self, prefix_hashes: Sequence[bytes], holder: str) -> int:
        """Remove the hashes that `holder` owns (others' entries stay); returns how many went."""
        self._check_hashes(prefix_hashes)
        removed = 0
        for h in prefix_hashes:
            entry = self._entries.get(h)
            if entry is not None and entry.holder == holder:
                self._remove(h, entry)
                removed += 1
        self.stats.unregistrations += removed
        self._maybe_compact()
        return removed

    def drop_holder(self, holder: str) -> int:
        """Remove every entry of a dead holder; returns how many went."""
        hashes = self._by_holder.pop(holder, set())
        for h in hashes:
            del self._entries[h]
        self.stats.dropped += len(hashes)
        self._maybe_compact()
        return len(hashes)

    def expire(self, now: float | None = None, limit: int | None = None) -> int:
        """Remove entries whose expiry time has passed (at most `limit`); returns how many went."""
        now = self.clock() if now is None else now
        removed = 0
        heap = self._heap
        while heap and heap[0][0] <= now and (limit is None or removed < limit):
            _, seq, h = heapq.heappop(heap)
            entry = self._entries.get(h)
            if entry is not None and entry.seq == seq:
                self._remove(h, entry)
                removed += 1
        self.stats.expirations += removed
        return removed

    def holders(self) -> int:
        return len(self._by_holder)

    # ---- internals ---------------------------------------------------------------------
    def _check_hashes(self, prefix_hashes: Sequence[bytes]) -> None:
        if not isinstance(prefix_hashes, (list, tuple)):
            raise InvalidRequest("prefix_hashes must be a list of bytes")
        if len(prefix_hashes) > self.limits.max_hashes_per_message:
            raise InvalidRequest(f"{len(prefix_hashes)} hashes in one message; "
                                 f"at most {self.limits.max_hashes_per_message}")
        for i, h in enumerate(prefix_hashes):
            if not isinstance(h, bytes) or not 0 < len(h) <= MAX_HASH_BYTES:
                raise InvalidRequest(f"prefix_hashes[{i}] must be 1..{MAX_HASH_BYTES} bytes")

    def _clamp_ttl(self, ttl_s: float | None) -> float:
        if ttl_s is None:
            return self.limits.default_ttl_s
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) \
                or not math.isfinite(ttl_s) or ttl_s <= 0:
            raise InvalidRequest(f"ttl_s must be a positive finite number of seconds, got {ttl_s!r}")
        return min(float(ttl_s), self.limits.max_ttl_s)

    def _evict_one(self) -> None:
        """Remove the live entry closest to expiry (skipping stale heap items)."""
        while True:
            _, seq, h = heapq.heappop(self._heap)
            entry = self._entries.get(h)
            if entry is not None and entry.seq == seq:
                self._remove(h, entry)
                self.stats.evictions += 1
                return

    def _remove(self, h: bytes, entry: _Entry) -> None:
        del self._entries[h]
        self._unindex(h, entry.holder)

    def _unindex(self, h: bytes, holder: str) -> None:
        owned = self._by_holder.get(holder)
        if owned is not None:
            owned.discard(h)
            if not owned:
                del self._by_holder[holder]

    def _maybe_compact(self) -> None:
        if len(self._heap) > 2 * len(self._entries) + _COMPACT_SLACK:
            self._heap = [(e.expires_at, e.seq, h) for h, e in self._entries.items()]
            heapq.heapify(self._heap)
