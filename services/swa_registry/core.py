"""SwaRegistry: which workers hold the sliding-window state for which prefix block, for a while.

Pure and synchronous, with an injectable clock (pass `now`, or leave it out and the registry asks
its `clock`). An entry is one (prefix hash, holder address) pair with an expiry time; a hash keeps
up to `max_holders_per_hash` holders, the latest registration first. Several holders matter: a
window computed by two workers stays findable when one of them dies or restarts (with one holder
per hash, the latest registration hid every other process that held the state).

Holders are processes, not addresses (holders.py): a registration or fetch naming a new
incarnation at an address drops everything the old process registered there at once, and a holder
that has named an incarnation but then stays silent past `holder_timeout_s` loses its entries
(`expire_holders`, called every fraction of that timeout).

Expired entries are misses at once and are removed by `expire()`, which pops a min-heap keyed by
expiry time, so each call costs only the entries it removes. Replaced or removed entries leave
stale heap items behind; they are skipped on pop and the heap is rebuilt when they outnumber the
live ones.

Bounded: at most `max_entries` entries (when full, the entries closest to expiry are evicted and
counted), TTLs clamped to `max_ttl_s`, at most `max_hashes_per_message` hashes per call, hashes of
1..64 bytes, at most `max_holders` tracked processes. Bad input raises InvalidRequest before
anything changes.
"""
from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from messages.errors import InvalidRequest
from services.swa_registry.holders import CheckIn, HolderTable

MAX_HASH_BYTES = 64
MAX_HOLDER_CHARS = 256
MAX_INCARNATION_CHARS = 64
_COMPACT_SLACK = 1024     # stale heap items tolerated beyond the live entries before a rebuild


@dataclass(slots=True, frozen=True)
class RegistryLimits:
    default_ttl_s: float = 180.0          # DeepSeek's: SWA state TTL ~180 s, hit rate > 98%
    max_ttl_s: float = 600.0
    max_entries: int = 1_000_000
    max_hashes_per_message: int = 4096
    max_holders_per_hash: int = 4         # the latest registrations of one window
    max_holders: int = 10_000             # processes tracked by incarnation

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_ttl_s) and self.max_ttl_s > 0):
            raise ValueError("max_ttl_s must be a positive finite number")
        if not (math.isfinite(self.default_ttl_s) and 0 < self.default_ttl_s <= self.max_ttl_s):
            raise ValueError("default_ttl_s must be in (0, max_ttl_s]")
        if min(self.max_entries, self.max_hashes_per_message, self.max_holders_per_hash, self.max_holders) < 1:
            raise ValueError("max_entries, max_hashes_per_message, max_holders_per_hash and max_holders must be >= 1")


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
    dropped: int = 0          # removed because their holder died, went silent or restarted
    restarts: int = 0         # holders seen with a new incarnation at their old address


class _Entry:
    __slots__ = ("expires_at", "seq")

    def __init__(self, expires_at: float, seq: int):
        self.expires_at = expires_at
        self.seq = seq            # matches exactly one heap item; older items for this pair are stale


class SwaRegistry:
    def __init__(self, limits: RegistryLimits | None = None, clock: Callable[[], float] = time.monotonic,
                 holder_timeout_s: float = 3.0):
        self.limits = limits or RegistryLimits()
        self.clock = clock
        self.stats = RegistryStats()
        self.tracked = HolderTable(holder_timeout_s)
        self._entries: dict[bytes, dict[str, _Entry]] = {}   # hash -> holder -> entry, latest last
        self._by_holder: dict[str, set[bytes]] = {}
        self._heap: list[tuple[float, int, bytes, str]] = []    # (expires_at, seq, hash, holder)
        self._count = 0
        self._seq = 0

    def __len__(self) -> int:
        return self._count

    # ---- processes -------------------------------------------------------------------------
    def check_in(self, holder: str, incarnation: str, now: float | None = None, answered: bool = False) -> CheckIn:
        """A sign of life of process `incarnation` at `holder` (see holders.py); a new process
        there drops its predecessor's entries at once."""
        self._check_holder(holder)
        if not isinstance(incarnation, str) or not 0 < len(incarnation) <= MAX_INCARNATION_CHARS:
            raise InvalidRequest(f"incarnation must be a non-empty id of at most {MAX_INCARNATION_CHARS} chars")
        if len(self.tracked) >= self.limits.max_holders and not self.tracked.incarnation(holder):
            raise InvalidRequest(f"the registry already tracks {self.limits.max_holders} holders")
        seen = self.tracked.check_in(holder, incarnation, self.clock() if now is None else now, answered)
        if seen is CheckIn.REPLACED:
            self.stats.restarts += 1
            self._drop(holder)
        return seen

    def expire_holders(self, now: float | None = None) -> list[str]:
        """Forget the holders silent past the timeout and drop their entries; their addresses."""
        silent = self.tracked.expire(self.clock() if now is None else now)
        for holder in silent:
            self._drop(holder)
        return silent

    # ---- operations --------------------------------------------------------------------
    def register(self, prefix_hashes: Sequence[bytes], holder: str, ttl_s: float | None = None,
                 now: float | None = None, incarnation: str = "") -> int:
        """Record `holder` for every hash (as its latest holder; its TTL restarts); returns the count.
        From a retired incarnation nothing is recorded (0)."""
        return self.registration(prefix_hashes, holder, ttl_s, incarnation, now=now)[0]

    def registration(self, prefix_hashes: Sequence[bytes], holder: str, ttl_s: float | None, incarnation: str,
                     answered: bool = False, now: float | None = None) -> tuple[int, CheckIn | None]:
        """`register`, checking the process in first when it names one; (count, how it was seen)."""
        self._check_hashes(prefix_hashes)
        self._check_holder(holder)
        ttl = self._clamp_ttl(ttl_s)
        now = self.clock() if now is None else now
        seen = self.check_in(holder, incarnation, now, answered) if incarnation else None
        if seen is CheckIn.STALE:
            return 0, seen
        self._add(prefix_hashes, holder, now + ttl, now)
        return len(prefix_hashes), seen

    def _add(self, prefix_hashes: Sequence[bytes], holder: str, expires_at: float, now: float) -> None:
        for h in prefix_hashes:
            holders = self._entries.get(h)
            if holders is not None and holder in holders:
                del holders[holder]           # re-inserted below: the latest registration goes last
                self._count -= 1
            else:
                if self._count >= self.limits.max_entries:
                    self.expire(now)
                while self._count >= self.limits.max_entries:
                    self._evict_one()
                holders = self._entries.get(h)
                while holders is not None and len(holders) >= self.limits.max_holders_per_hash:
                    oldest = next(iter(holders))
                    self._remove(h, oldest)
                    self.stats.evictions += 1
                    holders = self._entries.get(h)
            self._seq += 1
            self._entries.setdefault(h, {})[holder] = _Entry(expires_at, self._seq)
            self._count += 1
            self._by_holder.setdefault(holder, set()).add(h)
            heapq.heappush(self._heap, (expires_at, self._seq, h, holder))
        self.stats.registrations += len(prefix_hashes)
        self._maybe_compact()

    def lookup(self, prefix_hashes: Sequence[bytes], now: float | None = None) -> list[str]:
        """The latest live holder of each hash, or "" where none is registered or all expired."""
        self._check_hashes(prefix_hashes)
        now = self.clock() if now is None else now
        holders = [next(self._live_holders(h, now), "") for h in prefix_hashes]
        self._count_lookups(len(holders), sum(1 for holder in holders if holder))
        return holders

    def choose(self, prefix_hashes: Sequence[bytes], requester: str,
               now: float | None = None) -> tuple[str, list[bytes]]:
        """For a fetch: the latest live holder other than `requester` of the first hash that has one,
        and every asked hash it holds; ("", []) when none."""
        self._check_hashes(prefix_hashes)
        now = self.clock() if now is None else now
        for i, h in enumerate(prefix_hashes):
            holder = next((x for x in self._live_holders(h, now) if x != requester), "")
            if holder:
                held = [p for p in prefix_hashes[i:] if self._holds(p, holder, now)]
                self._count_lookups(len(prefix_hashes), len(held))
                return holder, held
        self._count_lookups(len(prefix_hashes), 0)
        return "", []

    def unregister(self, prefix_hashes: Sequence[bytes], holder: str) -> int:
        """Remove `holder`'s entries for these hashes (other holders' stay); returns how many went."""
        self._check_hashes(prefix_hashes)
        removed = 0
        for h in prefix_hashes:
            if holder in self._entries.get(h, ()):
                self._remove(h, holder)
                removed += 1
        self.stats.unregistrations += removed
        self._maybe_compact()
        return removed

    def drop_holder(self, holder: str) -> int:
        """Remove every entry of a dead holder and forget its process; returns how many went."""
        self.tracked.forget(holder)
        return self._drop(holder)

    def expire(self, now: float | None = None, limit: int | None = None) -> int:
        """Remove entries whose expiry time has passed (at most `limit`); returns how many went."""
        now = self.clock() if now is None else now
        removed = 0
        heap = self._heap
        while heap and heap[0][0] <= now and (limit is None or removed < limit):
            _, seq, h, holder = heapq.heappop(heap)
            if self._is_current(h, holder, seq):
                self._remove(h, holder)
                removed += 1
        self.stats.expirations += removed
        return removed

    def holders(self) -> int:
        """Addresses that hold at least one entry."""
        return len(self._by_holder)

    # ---- internals ---------------------------------------------------------------------
    def _live_holders(self, h: bytes, now: float):
        """Holders of `h` whose entry has not expired, latest first."""
        for holder, entry in reversed(self._entries.get(h, {}).items()):
            if entry.expires_at > now:
                yield holder

    def _holds(self, h: bytes, holder: str, now: float) -> bool:
        entry = self._entries.get(h, {}).get(holder)
        return entry is not None and entry.expires_at > now

    def _count_lookups(self, asked: int, hits: int) -> None:
        self.stats.lookups += asked
        self.stats.hits += hits
        self.stats.misses += asked - hits

    def _check_hashes(self, prefix_hashes: Sequence[bytes]) -> None:
        if not isinstance(prefix_hashes, (list, tuple)):
            raise InvalidRequest("prefix_hashes must be a list of bytes")
        if len(prefix_hashes) > self.limits.max_hashes_per_message:
            raise InvalidRequest(f"{len(prefix_hashes)} hashes in one message; "
                                 f"at most {self.limits.max_hashes_per_message}")
        for i, h in enumerate(prefix_hashes):
            if not isinstance(h, bytes) or not 0 < len(h) <= MAX_HASH_BYTES:
                raise InvalidRequest(f"prefix_hashes[{i}] must be 1..{MAX_HASH_BYTES} bytes")

    @staticmethod
    def _check_holder(holder: str) -> None:
        if not isinstance(holder, str) or not 0 < len(holder) <= MAX_HOLDER_CHARS:
            raise InvalidRequest(f"holder must be a non-empty address of at most {MAX_HOLDER_CHARS} chars")

    def _clamp_ttl(self, ttl_s: float | None) -> float:
        if ttl_s is None:
            return self.limits.default_ttl_s
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) \
                or not math.isfinite(ttl_s) or ttl_s <= 0:
            raise InvalidRequest(f"ttl_s must be a positive finite number of seconds, got {ttl_s!r}")
        return min(float(ttl_s), self.limits.max_ttl_s)

    def _is_current(self, h: bytes, holder: str, seq: int) -> bool:
        entry = self._entries.get(h, {}).get(holder)
        return entry is not None and entry.seq == seq

    def _evict_one(self) -> None:
        """Remove the live entry closest to expiry (skipping stale heap items)."""
        while True:
            _, seq, h, holder = heapq.heappop(self._heap)
            if self._is_current(h, holder, seq):
                self._remove(h, holder)
                self.stats.evictions += 1
                return

    def _drop(self, holder: str) -> int:
        hashes = list(self._by_holder.get(holder, ()))
        for h in hashes:
            self._remove(h, holder)
        self.stats.dropped += len(hashes)
        self._maybe_compact()
        return len(hashes)

    def _remove(self, h: bytes, holder: str) -> None:
        holders = self._entries[h]
        del holders[holder]
        if not holders:
            del self._entries[h]
        self._count -= 1
        owned = self._by_holder.get(holder)
        if owned is not None:
            owned.discard(h)
            if not owned:
                del self._by_holder[holder]

    def _maybe_compact(self) -> None:
        if len(self._heap) > 2 * self._count + _COMPACT_SLACK:
            self._heap = [(e.expires_at, e.seq, h, holder)
                          for h, holders in self._entries.items() for holder, e in holders.items()]
            heapq.heapify(self._heap)
