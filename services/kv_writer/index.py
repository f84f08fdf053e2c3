"""BlockIndex: block hash -> where its record lives, with longest-prefix lookup over a hash chain.

Shared by the writer (`SegmentStore`) and by readers in other processes (`StoreReader`); pure and
in memory. It is an open-addressing hash table (linear probing, at most half full) in numpy arrays
rather than a dict of objects: a chain is looked up with a few vectorized gathers (every key's home
slot at once, then windows of the displaced keys' probe sequences), where a dict pays three or four
cache misses per block, one block at a time; an entry costs ~145 bytes of table instead of
~250 bytes of Python objects, and nothing for the garbage collector to walk. Keys are 1..32 bytes.

Layout: what a probe reads sits together in one 32-byte row per slot (`_Table.hot`: the slot's
state word, the key's first 16 bytes as two uint64 words, the record's expiry), rows aligned two to
a cache line, so a lookup pays one cache miss per key and compares keys as whole words; the rest
(the key's bytes 16..31, the record's segment, offset and length) sits in columns read only when
needed. Lookups are counted in numpy calls (about a microsecond each here, whatever their size):
one round for every key's home row, one for the displaced keys' next slots, a loop for the last few.

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

from services.kv_writer import record as fmt
from services.kv_writer.indexkeys import KEY_BYTES, Keys

__all__ = ["BlockIndex", "Location", "KEY_BYTES"]

_EMPTY, _TOMB = 0, 255                      # slot state word: free, or freed (probe past it); else key length
_MIN_CAPACITY = 1 << 10
_M1, _M2 = np.uint64(0xC2B2AE3D27D4EB4F), np.uint64(0x165667B19E3779F9)
_MIX = np.uint64(0xFF51AFD7ED558CCD)
_U64 = (1 << 64) - 1
_STATE, _W0, _W1, _EXP = range(4)           # the columns of a hot row
_FIRST_WINDOW, _WINDOW = 4, 8               # slots compared per key in the second round, then later ones (4 or 8)
_FEW = 16                                   # this few keys left to probe: finish them one by one in Python,
_STEP = 4                                   # reading this many slots at a time


class Location:
    __slots__ = ("seq", "offset", "length", "expires_at")

    def __init__(self, seq: int, offset: int, length: int, expires_at: float):
        self.seq = seq
        self.offset = offset
        self.length = length
        self.expires_at = expires_at

    def __repr__(self) -> str:
        return f"Location({self.seq}:{self.offset}:{self.length}, expires_at={self.expires_at})"


def _aligned_zeros(shape: tuple[int, ...], dtype, align: int = 64) -> np.ndarray:
    """Zeros whose first byte starts a cache line (so two 32-byte rows share one line)."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape))
    buf = np.zeros(size * dtype.itemsize + align, np.uint8)
    start = -buf.ctypes.data % align
    return buf[start:start + size * dtype.itemsize].view(dtype).reshape(shape)


class _Table:
    __slots__ = ("shift", "mask", "hot", "state", "expires", "tail", "seq", "offset", "length", "used")

    def __init__(self, capacity: int):
        self.shift = np.uint64(65 - capacity.bit_length())   # keeps the top log2(capacity) bits
        self.mask = capacity - 1
        self.hot = _aligned_zeros((capacity, 4), np.uint64)   # state, key words 0 and 1, expiry (f8 bits)
        self.state = self.hot[:, _STATE]                      # views into `hot`
        self.expires = self.hot[:, _EXP].view(np.float64)
        self.tail = np.zeros((capacity, 2), np.uint64)        # key bytes 16..31 (zeros for shorter keys)
        self.seq = np.zeros(capacity, np.int64)
        self.offset = np.zeros(capacity, np.int64)
        self.length = np.zeros(capacity, np.int64)
        self.used = 0                        # live + freed slots (probe sequences pass both)

    def home(self, keys: Keys) -> np.ndarray:
        """Each key's first slot: its first 16 bytes and length, mixed (uniform for any keys)."""
        h = keys.w1 * _M1
        h ^= keys.w0
        if not isinstance(keys.lens, int):       # (16-byte keys: nothing to add)
            h ^= (keys.lens ^ np.uint8(16)).astype(np.uint64) * _M2
        elif keys.lens != 16:                    # (as a Python int: numpy scalars warn on overflow)
            h ^= np.uint64((keys.lens ^ 16) * int(_M2) & _U64)
        h *= _MIX                                # multiplicative hashing: the top bits mix every bit
        h >>= self.shift
        return h.view(np.int64)

    def live(self) -> np.ndarray:
        return np.flatnonzero((self.state != _EMPTY) & (self.state != _TOMB))


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
        slots = _find(t, Keys(keys))
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
        heads = np.ascontiguousarray(t.hot[live, _W0:_W1 + 1]).tobytes()
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
        words[:, :2], words[:, 2:] = t.hot[live, _W0:_W1 + 1], t.tail[live]
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
        old = _find(t, k)
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
            t, old = grown, _find(grown, k)
        _insert(t, k.take(take), seqs[take], offsets[take], lengths[take], expires[take])
        replaced = old[take & (old >= 0)]
        t.state[replaced] = _TOMB                  # after the new slots: a lookup sees one or the other
        self._live += count - len(replaced)
        return count

    def drop_key(self, key: bytes, seq: int, offset: int) -> bool:
        """Forget `key` if it still points at that record (a corrupt record found on read)."""
        t = self._t
        s = int(_find(t, Keys([key]))[0])
        if s < 0 or t.seq[s] != seq or t.offset[s] != offset:
            return False
        t.state[s] = _TOMB
        self._live -= 1
        return True

    def drop_segment(self, seq: int) -> int:
        """Forget every key whose current record lives in segment `seq`; returns how many went."""
        return self.drop_segments([seq])

    def drop_segments(self, seqs: Sequence[int]) -> int:
        t = self._t
        hit = np.nonzero(np.isin(t.seq, np.asarray(seqs, np.int64)) & (t.state != _EMPTY) & (t.state != _TOMB))[0]
        t.state[hit] = _TOMB
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
    def _prefix_slots(t: _Table, chain: Sequence[bytes], now: float) -> np.ndarray:
        if not chain:
            return np.zeros(0, np.int64)
        slots = _find_prefix(t, Keys(chain))
        alive = t.expires[slots] > now               # rows just read: cached
        first = int(alive.argmin()) if len(alive) else 0
        return slots if not len(alive) or alive[first] else slots[:first]

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
        live = t.live()
        moved = Keys.of(t.hot[live, _W0:_W1 + 1], t.tail[live], t.state[live].astype(np.uint8))
        _insert(new, moved, t.seq[live], t.offset[live], t.length[live], t.expires[live])
        self._t = new
        return new


# ---- probing and placing ----------------------------------------------------------------------
def _first_round(t: _Table, keys: Keys) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every key's home slot, its state word and whether the key is there."""
    slot = t.home(keys)
    rows = t.hot.take(slot, axis=0)          # one gather, one cache miss per key
    state = rows[:, _STATE]
    match = rows[:, _W0] == keys.w0
    match &= rows[:, _W1] == keys.w1
    match &= state == keys.lens
    if keys.tail is not None:
        match &= _tails_equal(t.tail.take(slot, axis=0), keys.tail)
    return slot, state, match


def _find(t: _Table, keys: Keys) -> np.ndarray:
    """The slot of each key, -1 where absent. The first round reads every key's home row; the keys
    found neither there nor absent (a free slot without a match: a key sits before the first free
    slot of its probe sequence) go on to windows of their probe sequences."""
    slot, state, match = _first_round(t, keys)
    if match[match.argmin()]:                # all found at home (argmin: the first miss, if any)
        return slot
    out = np.where(match, slot, -1)
    todo = np.logical_not(match | (state == _EMPTY)).nonzero()[0]
    if todo.size:
        _probe_on(t, keys, todo, slot[todo] + 1, out, None)
    return out


def _find_prefix(t: _Table, keys: Keys) -> np.ndarray:
    """The slots of the leading keys that are present: `_find` up to the first absent key, leaving
    out the keys after it once it is known."""
    slot, state, match = _first_round(t, keys)
    if match[match.argmin()]:
        return slot
    empty = state == _EMPTY
    cut = int(empty.argmax())                # the first key known absent, if any
    cut = cut if empty[cut] else keys.n
    todo = np.logical_not(match[:cut]).nonzero()[0]
    if todo.size:                            # found ones get their slot written over the home slot
        cut = _probe_on(t, keys, todo, slot[todo] + 1, slot, cut)
    return slot[:cut]


def _probe_on(t: _Table, keys: Keys, todo: np.ndarray, start: np.ndarray, out: np.ndarray,
              cut: int | None) -> int | None:
    """Rounds over windows of the `todo` keys' probe sequences (from slot `start`), writing the slot
    of each found key into `out`. For a prefix, `cut` is the first key known absent: keys after it
    are left alone, and the first absent one is returned (None: every key matters, -1 marks the
    absent ones in `out`). A numpy call costs about a microsecond whatever its size, so a round is
    kept to few of them, and the last few keys go one by one."""
    width = _FIRST_WINDOW                    # most displaced keys sit one or two slots on
    while len(todo) > _FEW:
        # Flat: `width` candidates per key, one after another (numpy broadcasts [k, 1] against
        # [k, width] a row at a time: slow for short rows).
        n = len(todo)
        each = todo.repeat(width)            # the key of each candidate
        cand = start.repeat(width)
        cand += _spread(width, n)
        cand &= t.mask
        rows = t.hot.take(cand, axis=0)      # [n * width, 4]
        words = keys.words[each]
        state = rows[:, _STATE]
        found = rows[:, _W0] == words[:, 0]
        found &= rows[:, _W1] == words[:, 1]
        found &= state == (keys.lens if isinstance(keys.lens, int) else keys.lens[each])
        if keys.tail is not None:
            found &= _tails_equal(t.tail.take(cand, axis=0), keys.tail[each])
        at = found.nonzero()[0]              # a key sits at most once before a free slot (twice
        out[each[at]] = cand[at]             # while re-published: either will do)
        hit = _any_per_row(found.reshape(n, width))
        free = _any_per_row((state == _EMPTY).reshape(n, width))
        going = ~(hit | free)                # neither found nor a free slot seen: probe on
        if cut is not None:
            absent = free > hit
            first = int(absent.argmax())
            if absent[first]:                # keys come in order: the earliest absent one
                cut = int(todo[first])
                going[first:] = False
        todo, start = todo[going], start[going] + width
        width = _WINDOW
    if len(todo):
        cut = _probe_each(t, keys, todo.tolist(), start.tolist(), out, cut)
    return cut


def _probe_each(t: _Table, keys: Keys, todo: list[int], start: list[int], out: np.ndarray,
                cut: int | None) -> int | None:
    """`_probe_on` for a few keys, one at a time in plain Python (a numpy round costs more)."""
    hot, mask, tails = t.hot, t.mask, t.tail
    words = keys.words[todo].tolist()
    lens = [keys.lens] * len(todo) if isinstance(keys.lens, int) else keys.lens[todo].tolist()
    key_tails = None if keys.tail is None else keys.tail[todo].tolist()
    for k, i in enumerate(todo):
        if cut is not None and i >= cut:
            break
        want, s, found = [lens[k], *words[k]], start[k], -1    # a hot row starts with state, w0, w1
        while found == -1:
            s &= mask
            for row in hot[s:s + _STEP].tolist():   # stops at the table's end: the next pass wraps
                if row[0] == _EMPTY:
                    found = -2
                    break
                if row[:3] == want and (key_tails is None or tails[s].tolist() == key_tails[k]):
                    found = s
                    break
                s += 1
        if found >= 0:
            out[i] = found
        elif cut is not None:                   # absent: the prefix ends here
            return i
    return cut


_SPREADS = {w: np.tile(np.arange(w), 1 << 12) for w in (_FIRST_WINDOW, _WINDOW)}


def _spread(width: int, n: int) -> np.ndarray:
    """0, 1, .., width - 1, n times over."""
    spread = _SPREADS[width]
    return spread[:n * width] if n * width <= len(spread) else np.tile(np.arange(width), n)


def _any_per_row(flags: np.ndarray) -> np.ndarray:
    """`flags.any(axis=1)` for a contiguous [n, 4] or [n, 8] bool array, as one word per row (numpy's
    reduction over a short axis costs ~15 ns a row)."""
    return flags.view(np.uint32 if flags.shape[1] == 4 else np.uint64)[:, 0] != 0


def _tails_equal(rows: np.ndarray, tails: np.ndarray) -> np.ndarray:
    eq = rows[..., 0] == tails[..., 0]
    eq &= rows[..., 1] == tails[..., 1]
    return eq


def _insert(t: _Table, keys: Keys, seqs, offsets, lengths, expires) -> None:
    """Place keys that need a slot: rounds of one winner per free slot; the others probe on."""
    slot = t.home(keys)
    lens, tails = keys.lens_array(), keys.tail_array()
    values = np.empty((keys.n, 3), np.uint64)     # the hot row after the state word
    values[:, 0], values[:, 1], values[:, 2] = keys.w0, keys.w1, np.asarray(expires, np.float64).view(np.uint64)
    todo = np.arange(keys.n)
    while todo.size:
        s = slot[todo]
        st = t.state[s]
        free = (st == _EMPTY) | (st == _TOMB)
        won_slots, first = np.unique(s[free], return_index=True)
        won = todo[free][first]
        t.used += int((t.state[won_slots] == _EMPTY).sum())
        t.tail[won_slots] = tails[won]
        t.seq[won_slots] = seqs[won]
        t.offset[won_slots] = offsets[won]
        t.length[won_slots] = lengths[won]
        t.hot[won_slots, _W0:] = values[won]
        t.state[won_slots] = lens[won]             # last: the slot becomes visible
        placed = np.zeros(keys.n, bool)
        placed[won] = True
        todo = todo[~placed[todo]]
        slot[todo] = (slot[todo] + 1) & t.mask
