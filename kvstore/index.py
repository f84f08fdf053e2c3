"""BlockIndex: block hash -> where its record lives, with longest-prefix lookup over a hash chain.

Shared by the writer (`SegmentStore`) and by readers in other processes (`StoreReader`); pure and
in memory. It is an open-addressing hash table (linear probing, at most half full) in numpy arrays
rather than a dict of objects: a chain is looked up with a few vectorized gathers (every key's home
slot at once, then windows of the displaced keys' probe sequences), where a dict pays three or four
cache misses per block, one block at a time; an entry costs ~145 bytes of table instead of
~250 bytes of Python objects, and nothing for the garbage collector to walk. Keys are 1..32 bytes.
The table itself (layout, hashing, probing and placing) is in table.py.

Threads: one thread mutates; lookups from other threads may run at the same time. A slot's key,
expiry and values are written before its state word (the key's length) makes it visible, in a later
numpy call; a lookup copies each row in one piece (32 aligned bytes in one cache line). A
re-published key gets a new slot before its old slot is cleared; growing builds a new table and
swaps one reference. So a concurrent lookup sees each entry before or after a change (a dropped
entry may still be seen once: reads check the record itself anyway).

When two records hold the same hash (a block re-written to extend its life), the one that expires
later wins, whichever order the facts arrive in (a rebuild sees segments in any order).
"""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from kvstore import record as fmt
from kvstore.indexkeys import KEY_BYTES, Keys
from kvstore.table import EMPTY, MIN_CAPACITY, TOMB, W0, W1, Table, find, find_prefix, insert

__all__ = ["BlockIndex", "Location", "KEY_BYTES"]


class Location:
    __slots__ = ("seq", "offset", "length", "expires_at")

    def __init__(self, seq: int, offset: int, length: int, expires_at: float):
        self.seq = seq
        self.offset = offset
        self.length = length
        self.expires_at = expires_at

    def __repr__(self) -> str:
        return f"Location({self.seq}:{self.offset}:{self.length}, expires_at={self.expires_at})"


class BlockIndex:
    def __init__(self):
        self._t = Table(MIN_CAPACITY)
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def __contains__(self, key: bytes) -> bool:
        return self.get(key) is not None

    # ---- reads (any thread) ---------------------------------------------------------------
    def get(self, key: bytes) -> Location | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[bytes]) -> list[Location | None]:
        if not keys:
            return []
        t = self._t
        slots = find(t, Keys(keys))
        return [self._location(t, s) if s >= 0 else None for s in slots.tolist()]

    def longest_prefix(self, chain: Sequence[bytes], now: float) -> int:
        """How many leading hashes of `chain` are present and unexpired."""
        return len(self._prefix_slots(self._t, chain, now))

    def prefix_locations(self, chain: Sequence[bytes], now: float) -> list[Location]:
        """Where each leading present and unexpired block of `chain` lives."""
        t = self._t
        return [self._location(t, s) for s in self._prefix_slots(t, chain, now).tolist()]

    def items(self) -> Iterator[tuple[bytes, Location]]:
        t = self._t
        live = t.live()
        heads = np.ascontiguousarray(t.hot[live, W0:W1 + 1]).tobytes()
        tails = t.tail[live].tobytes()
        for i, s in enumerate(live.tolist()):
            length = int(t.state[s])
            key = heads[16 * i:16 * i + min(length, 16)]
            if length > 16:
                key += tails[16 * i:16 * i + length - 16]
            yield key, self._location(t, s)

    # ---- changes (one thread) ---------------------------------------------------------------
    def put(self, key: bytes, loc: Location) -> bool:
        """Publish `loc` for `key` unless a record expiring later is already there; True if taken."""
        return self.put_many([key], [loc.seq], [loc.offset], [loc.length], [loc.expires_at]) == 1

    def put_many(self, keys: Sequence[bytes], seqs, offsets, lengths, expires) -> int:
        """`put` for many records at once (the one expiring last wins among repeats); returns how
        many were taken."""
        if not keys:
            return 0
        return self._put(Keys(keys), np.asarray(seqs, np.int64), np.asarray(offsets, np.int64),
                         np.asarray(lengths, np.int64), np.asarray(expires, np.float64), len(set(keys)) < len(keys))

    def put_entries(self, arr: np.ndarray) -> int:
        """`put_many` for index entries (record.ENTRY_DTYPE records, e.g. a segment footer)."""
        if not len(arr):
            return 0
        k = Keys.of_entries(arr)
        return self._put(k, arr["seq"].astype(np.int64), arr["offset"].astype(np.int64),
                         arr["length"].astype(np.int64), arr["expires"].astype(np.float64), None)

    def export(self) -> np.ndarray:
        """Every live entry as PUT index entries (record.ENTRY_DTYPE), for a snapshot."""
        t = self._t
        live = t.live()
        n = len(live)
        arr = np.zeros(n, fmt.ENTRY_DTYPE)
        arr["kind"], arr["key_len"] = fmt.PUT, t.state[live]
        arr["seq"], arr["offset"], arr["length"], arr["expires"] = t.seq[live], t.offset[live], t.length[live], \
            t.expires[live]
        words = np.empty((n, 4), np.uint64)
        words[:, :2], words[:, 2:] = t.hot[live, W0:W1 + 1], t.tail[live]
        arr["key"] = words.view("V32").reshape(n)
        return arr

    def _put(self, k: Keys, seqs, offsets, lengths, expires, repeats: bool | None) -> int:
        if repeats is None or repeats:   # the same key twice in one call: keep the one expiring last
            ids = k.ids()
            if repeats or len(np.unique(ids)) < k.n:
                order = np.lexsort((seqs, expires, ids))
                last = np.flatnonzero(np.r_[ids[order][1:] != ids[order][:-1], True])
                keep = np.sort(order[last])
                k, seqs, offsets, lengths, expires = k.take(keep), seqs[keep], offsets[keep], lengths[keep], \
                    expires[keep]
        t = self._t
        old = find(t, k)
        present = old >= 0
        take = ~present
        if present.any():
            o = old[present]
            e, q = expires[present], seqs[present]
            take[present] = (t.expires[o] < e) | ((t.expires[o] == e) & (t.seq[o] < q))
        count = int(take.sum())
        if not count:
            return 0
        grown = self._room(count)
        if grown is not t:   # slots moved
            t, old = grown, find(grown, k)
        insert(t, k.take(take), seqs[take], offsets[take], lengths[take], expires[take])
        replaced = old[take & (old >= 0)]
        t.state[replaced] = TOMB                  # after the new slots: a lookup sees one or the other
        self._live += count - len(replaced)
        return count

    def drop_key(self, key: bytes, seq: int, offset: int) -> bool:
        """Forget `key` if it still points at that record (a corrupt record found on read)."""
        t = self._t
        s = int(find(t, Keys([key]))[0])
        if s < 0 or t.seq[s] != seq or t.offset[s] != offset:
            return False
        t.state[s] = TOMB
        self._live -= 1
        return True

    def drop_segment(self, seq: int) -> int:
        """Forget every key whose current record lives in segment `seq`; returns how many went."""
        return self.drop_segments([seq])

    def drop_segments(self, seqs: Sequence[int]) -> int:
        t = self._t
        hit = np.nonzero(np.isin(t.seq, np.asarray(seqs, np.int64)) & (t.state != EMPTY) & (t.state != TOMB))[0]
        t.state[hit] = TOMB
        self._live -= len(hit)
        return len(hit)

    def clear(self) -> None:
        self._t = Table(MIN_CAPACITY)
        self._live = 0

    # ---- the table --------------------------------------------------------------------------
    @staticmethod
    def _location(t: Table, s: int) -> Location:
        return Location(int(t.seq[s]), int(t.offset[s]), int(t.length[s]), float(t.expires[s]))

    @staticmethod
    def _prefix_slots(t: Table, chain: Sequence[bytes], now: float) -> np.ndarray:
        if not chain:
            return np.zeros(0, np.int64)
        slots = find_prefix(t, Keys(chain))
        alive = t.expires[slots] > now               # rows just read: cached
        first = int(alive.argmin()) if len(alive) else 0
        return slots if not len(alive) or alive[first] else slots[:first]

    def _room(self, incoming: int) -> Table:
        """The table to insert into: this one, or (past half full) a larger one with the live
        entries moved over, swapped in as one reference."""
        t = self._t
        if t.used + incoming <= (t.mask + 1) // 2:
            return t
        capacity = MIN_CAPACITY
        while capacity < 4 * (self._live + incoming):
            capacity *= 2
        new = Table(capacity)
        live = t.live()
        moved = Keys.of(t.hot[live, W0:W1 + 1], t.tail[live], t.state[live].astype(np.uint8))
        insert(new, moved, t.seq[live], t.offset[live], t.length[live], t.expires[live])
        self._t = new
        return new
