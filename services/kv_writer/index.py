"""BlockIndex: block hash -> where its record lives, with longest-prefix lookup over a hash chain.

Shared by the writer (`SegmentStore`) and by readers in other processes (`StoreReader`); pure and
in memory. It is an open-addressing hash table (linear probing, at most half full) in numpy columns
rather than a dict of objects: a chain is looked up with a few vectorized gathers (every key's home
slot at once, then windows of 2, then 8 slots for the displaced), where a dict pays three or four
cache misses per block, one block at a time; an entry costs ~130 bytes of table instead of ~250 bytes of
Python objects, and nothing for the garbage collector to walk. Keys are 1..32 bytes.

Threads: one thread mutates; lookups from other threads may run at the same time. A slot's key and
values are written before its length byte makes it visible; a re-published key gets a new slot
before its old slot is cleared; growing builds a new table and swaps one reference. So a concurrent
lookup sees each entry before or after a change (a dropped entry may still be seen once: reads check
the record itself anyway).

When two records hold the same hash (a block re-written to extend its life), the one that expires
later wins, whichever order the facts arrive in (a rebuild sees segments in any order).
"""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from services.kv_writer import record as fmt

KEY_BYTES = 32
_EMPTY, _TOMB = 0, 255                      # slot length byte: free, or freed (probe past it)
_MIN_CAPACITY = 1 << 10
_M0, _M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F), np.uint64(0x165667B19E3779F9)
_MIX = np.uint64(0xFF51AFD7ED558CCD)
_WINDOW = 8                                 # slots of a probe sequence compared per round
_OFFSETS = np.arange(_WINDOW)


class Location:
    __slots__ = ("seq", "offset", "length", "expires_at")

    def __init__(self, seq: int, offset: int, length: int, expires_at: float):
        self.seq = seq
        self.offset = offset
        self.length = length
        self.expires_at = expires_at

    def __repr__(self) -> str:
        return f"Location({self.seq}:{self.offset}:{self.length}, expires_at={self.expires_at})"


class _Keys:
    """Keys as table columns: their first 16 bytes (`head`, void16, compared as one unit; `w0`, `w1`
    are its two uint64 words, for hashing), the next 16 (`tail`, None when every key is 16 bytes)
    and the lengths (an int when all equal)."""

    __slots__ = ("n", "head", "w0", "w1", "tail", "lens")

    def __init__(self, keys: Sequence[bytes]):
        n = self.n = len(keys)
        joined = b"".join(keys)
        if len(joined) == 16 * n and (not n or max(map(len, keys)) == 16):
            self.head, self.tail, self.lens = np.frombuffer(joined, "V16"), None, 16
            self.w0, self.w1 = _words(self.head)
            return
        lens = np.fromiter(map(len, keys), np.uint8, n)
        if n and (lens.min() < 1 or lens.max() > KEY_BYTES):
            raise ValueError(f"keys must be 1..{KEY_BYTES} bytes")
        halves = np.frombuffer(b"".join(k.ljust(KEY_BYTES, b"\0") for k in keys), "V16").reshape(n, 2)
        self.head, self.tail, self.lens = halves[:, 0].copy(), halves[:, 1].copy(), lens
        self.w0, self.w1 = _words(self.head)

    @classmethod
    def of(cls, n: int, head, tail, lens) -> "_Keys":
        out = cls.__new__(cls)
        out.n, out.head, out.tail, out.lens = n, np.ascontiguousarray(head), tail, lens
        out.w0, out.w1 = _words(out.head)
        return out

    def take(self, index) -> "_Keys":
        head = self.head[index]
        return _Keys.of(len(head), head, None if self.tail is None else self.tail[index],
                        self.lens if isinstance(self.lens, int) else self.lens[index])

    @classmethod
    def of_entries(cls, arr: np.ndarray) -> "_Keys":
        """The keys of index entries (record.ENTRY_DTYPE: zero-padded 32-byte keys and lengths)."""
        n = len(arr)
        halves = np.ascontiguousarray(arr["key"]).view("V16").reshape(n, 2)
        lens = arr["key_len"].astype(np.uint8)
        if n and (lens == 16).all():
            return cls.of(n, halves[:, 0], None, 16)
        if n and (lens.min() < 1 or lens.max() > KEY_BYTES):
            raise ValueError(f"keys must be 1..{KEY_BYTES} bytes")
        return cls.of(n, halves[:, 0], np.ascontiguousarray(halves[:, 1]), lens)

    def ids(self) -> np.ndarray:
        """A number per distinct key (equal keys, equal numbers)."""
        combo = np.empty(self.n, [("head", "V16"), ("tail", "V16"), ("len", "u1")])
        combo["head"], combo["tail"], combo["len"] = self.head, self.tail_array(), self.lens_array()
        return np.unique(combo, return_inverse=True)[1].reshape(-1)

    def lens_array(self) -> np.ndarray:
        return np.full(self.n, self.lens, np.uint8) if isinstance(self.lens, int) else self.lens

    def tail_array(self) -> np.ndarray:
        return np.zeros(self.n, "V16") if self.tail is None else self.tail


def _words(head: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    words = head.view(np.uint64).reshape(len(head), 2)
    return words[:, 0], words[:, 1]


class _Table:
    __slots__ = ("bits", "mask", "head", "tail", "klen", "seq", "offset", "length", "expires", "used")

    def __init__(self, capacity: int):
        self.bits = capacity.bit_length() - 1
        self.mask = capacity - 1
        self.head = np.zeros(capacity, "V16")
        self.tail = np.zeros(capacity, "V16")
        self.klen = np.zeros(capacity, np.uint8)
        self.seq = np.zeros(capacity, np.int64)
        self.offset = np.zeros(capacity, np.int64)
        self.length = np.zeros(capacity, np.int64)
        self.expires = np.zeros(capacity, np.float64)
        self.used = 0                        # live + freed slots (probe sequences pass both)

    def home(self, keys: _Keys) -> np.ndarray:
        """Each key's first slot: its first 16 bytes and length, mixed (uniform for any keys)."""
        lens = np.uint64(keys.lens) if isinstance(keys.lens, int) else keys.lens.astype(np.uint64)
        with np.errstate(over="ignore"):
            h = keys.w1 * _M1
            h ^= keys.w0 ^ (lens * _M2)
            h *= _MIX                        # multiplicative hashing: the top bits mix every bit
        h >>= np.uint64(64 - self.bits)
        return h.view(np.int64)


class BlockIndex:
    def __init__(self):
        self._t = _Table(_MIN_CAPACITY)
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
        slots = self._find(t, _Keys(keys))
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
        live = np.flatnonzero((t.klen != _EMPTY) & (t.klen != _TOMB))
        words = t.head[live].tobytes()
        tails = t.tail[live].tobytes()
        for i, s in enumerate(live.tolist()):
            length = int(t.klen[s])
            key = words[16 * i:16 * i + min(length, 16)]
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
        return self._put(_Keys(keys), np.asarray(seqs, np.int64), np.asarray(offsets, np.int64),
                         np.asarray(lengths, np.int64), np.asarray(expires, np.float64), len(set(keys)) < len(keys))

    def put_entries(self, arr: np.ndarray) -> int:
        """`put_many` for index entries (record.ENTRY_DTYPE records, e.g. a segment footer)."""
        if not len(arr):
            return 0
        k = _Keys.of_entries(arr)
        return self._put(k, arr["seq"].astype(np.int64), arr["offset"].astype(np.int64),
                         arr["length"].astype(np.int64), arr["expires"].astype(np.float64), None)

    def export(self) -> np.ndarray:
        """Every live entry as PUT index entries (record.ENTRY_DTYPE), for a snapshot."""
        t = self._t
        live = np.flatnonzero((t.klen != _EMPTY) & (t.klen != _TOMB))
        n = len(live)
        arr = np.zeros(n, fmt.ENTRY_DTYPE)
        arr["kind"], arr["key_len"] = fmt.PUT, t.klen[live]
        arr["seq"], arr["offset"], arr["length"], arr["expires"] = t.seq[live], t.offset[live], t.length[live], \
            t.expires[live]
        halves = np.empty((n, 2), "V16")
        halves[:, 0], halves[:, 1] = t.head[live], t.tail[live]
        arr["key"] = halves.view("V32").reshape(n)
        return arr

    def _put(self, k: _Keys, seqs, offsets, lengths, expires, repeats: bool | None) -> int:
        if repeats is None or repeats:   # the same key twice in one call: keep the one expiring last
            ids = k.ids()
            if repeats or len(np.unique(ids)) < k.n:
                order = np.lexsort((seqs, expires, ids))
                last = np.flatnonzero(np.r_[ids[order][1:] != ids[order][:-1], True])
                keep = np.sort(order[last])
                k, seqs, offsets, lengths, expires = k.take(keep), seqs[keep], offsets[keep], lengths[keep], \
                    expires[keep]
        t = self._t
        old = self._find(t, k)
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
            t, old = grown, self._find(grown, k)
        self._insert(t, k.take(take), seqs[take], offsets[take], lengths[take], expires[take])
        replaced = old[take & (old >= 0)]
        t.klen[replaced] = _TOMB                   # after the new slots: a lookup sees one or the other
        self._live += count - len(replaced)
        return count

    def drop_key(self, key: bytes, seq: int, offset: int) -> bool:
        """Forget `key` if it still points at that record (a corrupt record found on read)."""
        t = self._t
        s = int(self._find(t, _Keys([key]))[0])
        if s < 0 or t.seq[s] != seq or t.offset[s] != offset:
            return False
        t.klen[s] = _TOMB
        self._live -= 1
        return True

    def drop_segment(self, seq: int) -> int:
        """Forget every key whose current record lives in segment `seq`; returns how many went."""
        return self.drop_segments([seq])

    def drop_segments(self, seqs: Sequence[int]) -> int:
        t = self._t
        hit = np.nonzero(np.isin(t.seq, np.asarray(seqs, np.int64)) & (t.klen != _EMPTY) & (t.klen != _TOMB))[0]
        t.klen[hit] = _TOMB
        self._live -= len(hit)
        return len(hit)

    def clear(self) -> None:
        self._t = _Table(_MIN_CAPACITY)
        self._live = 0

    # ---- the table --------------------------------------------------------------------------
    @staticmethod
    def _location(t: _Table, s: int) -> Location:
        return Location(int(t.seq[s]), int(t.offset[s]), int(t.length[s]), float(t.expires[s]))

    @staticmethod
    def _find(t: _Table, keys: _Keys, stop: bool = False) -> np.ndarray:
        """The slot of each key, -1 where absent. The first round looks at every key's home slot;
        later rounds at windows of 2, then `_WINDOW` slots of the remaining keys' probe sequences (a key
        sits before the first free slot of its sequence, so a free slot without a match means
        absent). With `stop` (a prefix), keys after the first absent one are dropped once known."""
        slot = t.home(keys)
        kl = t.klen[slot]
        match = t.head[slot] == keys.head
        match &= kl == keys.lens
        if keys.tail is not None:
            match &= t.tail[slot] == keys.tail
        out = np.where(match, slot, -1)
        if match.all():
            return out
        absent = kl == _EMPTY
        if stop and absent.any():
            cut = int(absent.argmax())
            if match[:cut].all():
                return out
            todo = np.flatnonzero(~(match[:cut] | absent[:cut]))
        else:
            todo = np.flatnonzero(~(match | absent))
            cut = keys.n
        slot[todo] += 1
        width = 2                                # most displaced keys sit one or two slots on
        while todo.size:
            cand = (slot[todo, None] + _OFFSETS[:width]) & t.mask
            kl = t.klen[cand]
            want = keys.lens if isinstance(keys.lens, int) else keys.lens[todo, None]
            found = (t.head[cand] == keys.head[todo, None]) & (kl == want)
            if keys.tail is not None:
                found &= t.tail[cand] == keys.tail[todo, None]
            hit = found.any(axis=1)
            rows = np.flatnonzero(hit)
            out[todo[rows]] = cand[rows, found[rows].argmax(axis=1)]
            absent = ~hit & (kl == _EMPTY).any(axis=1)
            if stop and absent.any():
                cut = min(cut, int(todo[absent][0]))
            todo = todo[~(hit | absent)]
            if stop:
                todo = todo[todo < cut]
            slot[todo] += width
            width = _WINDOW
        return out

    def _prefix_slots(self, t: _Table, chain: Sequence[bytes], now: float) -> np.ndarray:
        if not chain:
            return np.zeros(0, np.int64)
        slots = self._find(t, _Keys(chain), stop=True)
        missing = np.flatnonzero(slots < 0)
        if missing.size:
            slots = slots[:missing[0]]
        expired = np.flatnonzero(t.expires[slots] <= now)
        return slots[:expired[0]] if expired.size else slots

    def _room(self, incoming: int) -> _Table:
        """The table to insert into: this one, or (past half full) a larger one with the live
        entries moved over, swapped in as one reference."""
        t = self._t
        if t.used + incoming <= (t.mask + 1) // 2:
            return t
        capacity = _MIN_CAPACITY
        while capacity < 4 * (self._live + incoming):
            capacity *= 2
        new = _Table(capacity)
        live = np.flatnonzero((t.klen != _EMPTY) & (t.klen != _TOMB))
        moved = _Keys.of(len(live), t.head[live], t.tail[live], t.klen[live])
        self._insert(new, moved, t.seq[live], t.offset[live], t.length[live], t.expires[live])
        self._t = new
        return new

    @staticmethod
    def _insert(t: _Table, keys: _Keys, seqs, offsets, lengths, expires) -> None:
        """Place keys that need a slot: rounds of one winner per free slot; the others probe on."""
        slot = t.home(keys)
        lens, tails = keys.lens_array(), keys.tail_array()
        todo = np.arange(keys.n)
        while todo.size:
            s = slot[todo]
            kl = t.klen[s]
            free = (kl == _EMPTY) | (kl == _TOMB)
            won_slots, first = np.unique(s[free], return_index=True)
            won = todo[free][first]
            t.used += int((t.klen[won_slots] == _EMPTY).sum())
            t.head[won_slots] = keys.head[won]
            t.tail[won_slots] = tails[won]
            t.seq[won_slots] = seqs[won]
            t.offset[won_slots] = offsets[won]
            t.length[won_slots] = lengths[won]
            t.expires[won_slots] = expires[won]
            t.klen[won_slots] = lens[won]          # last: the slot becomes visible
            placed = np.zeros(keys.n, bool)
            placed[won] = True
            todo = todo[~placed[todo]]
            slot[todo] = (slot[todo] + 1) & t.mask
