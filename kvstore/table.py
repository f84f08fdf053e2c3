"""The open-addressing hash table under BlockIndex: layout, hashing, probing and placing.

Linear probing, at most half full, in numpy arrays. What a probe reads sits together in one 32-byte
row per slot (`Table.hot`: the slot's state word, the key's first 16 bytes as two uint64 words, the
record's expiry), rows aligned two to a cache line, so a lookup pays one cache miss per key and
compares keys as whole words; the rest (the key's bytes 16..31, the record's segment, offset and
length) sits in columns read only when needed. Lookups are counted in numpy calls (about a
microsecond each here, whatever their size): one round for every key's home row, one for the
displaced keys' next slots, a loop for the last few.
"""
from __future__ import annotations

import numpy as np

from kvstore.indexkeys import Keys

EMPTY, TOMB = 0, 255                        # slot state word: free, or freed (probe past it); else key length
MIN_CAPACITY = 1 << 10
_M1, _M2 = np.uint64(0xC2B2AE3D27D4EB4F), np.uint64(0x165667B19E3779F9)
_MIX = np.uint64(0xFF51AFD7ED558CCD)
_U64 = (1 << 64) - 1
STATE, W0, W1, EXP = range(4)               # the columns of a hot row
_FIRST_WINDOW, _WINDOW = 4, 8               # slots compared per key in the second round, then later ones (4 or 8)
_FEW = 16                                   # this few keys left to probe: finish them one by one in Python,
_STEP = 4                                   # reading this many slots at a time


def _aligned_zeros(shape: tuple[int, ...], dtype, align: int = 64) -> np.ndarray:
    """Zeros whose first byte starts a cache line (so two 32-byte rows share one line)."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape))
    buf = np.zeros(size * dtype.itemsize + align, np.uint8)
    start = -buf.ctypes.data % align
    return buf[start:start + size * dtype.itemsize].view(dtype).reshape(shape)


class Table:
    __slots__ = ("shift", "mask", "hot", "state", "expires", "tail", "seq", "offset", "length", "used")

    def __init__(self, capacity: int):
        self.shift = np.uint64(65 - capacity.bit_length())   # keeps the top log2(capacity) bits
        self.mask = capacity - 1
        self.hot = _aligned_zeros((capacity, 4), np.uint64)   # state, key words 0 and 1, expiry (f8 bits)
        self.state = self.hot[:, STATE]                      # views into `hot`
        self.expires = self.hot[:, EXP].view(np.float64)
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
        return np.flatnonzero((self.state != EMPTY) & (self.state != TOMB))


def _first_round(t: Table, keys: Keys) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every key's home slot, its state word and whether the key is there."""
    slot = t.home(keys)
    rows = t.hot.take(slot, axis=0)          # one gather, one cache miss per key
    state = rows[:, STATE]
    match = rows[:, W0] == keys.w0
    match &= rows[:, W1] == keys.w1
    match &= state == keys.lens
    if keys.tail is not None:
        match &= _tails_equal(t.tail.take(slot, axis=0), keys.tail)
    return slot, state, match


def find(t: Table, keys: Keys) -> np.ndarray:
    """The slot of each key, -1 where absent. The first round reads every key's home row; the keys
    found neither there nor absent (a free slot without a match: a key sits before the first free
    slot of its probe sequence) go on to windows of their probe sequences."""
    slot, state, match = _first_round(t, keys)
    if match[match.argmin()]:                # all found at home (argmin: the first miss, if any)
        return slot
    out = np.where(match, slot, -1)
    todo = np.logical_not(match | (state == EMPTY)).nonzero()[0]
    if todo.size:
        _probe_on(t, keys, todo, slot[todo] + 1, out, None)
    return out


def find_prefix(t: Table, keys: Keys) -> np.ndarray:
    """The slots of the leading keys that are present: `find` up to the first absent key, leaving
    out the keys after it once it is known."""
    slot, state, match = _first_round(t, keys)
    if match[match.argmin()]:
        return slot
    empty = state == EMPTY
    cut = int(empty.argmax())                # the first key known absent, if any
    cut = cut if empty[cut] else keys.n
    todo = np.logical_not(match[:cut]).nonzero()[0]
    if todo.size:                            # found ones get their slot written over the home slot
        cut = _probe_on(t, keys, todo, slot[todo] + 1, slot, cut)
    return slot[:cut]


def _probe_on(t: Table, keys: Keys, todo: np.ndarray, start: np.ndarray, out: np.ndarray,
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
        state = rows[:, STATE]
        found = rows[:, W0] == words[:, 0]
        found &= rows[:, W1] == words[:, 1]
        found &= state == (keys.lens if isinstance(keys.lens, int) else keys.lens[each])
        if keys.tail is not None:
            found &= _tails_equal(t.tail.take(cand, axis=0), keys.tail[each])
        at = found.nonzero()[0]              # a key sits at most once before a free slot (twice
        out[each[at]] = cand[at]             # while re-published: either will do)
        hit = _any_per_row(found.reshape(n, width))
        free = _any_per_row((state == EMPTY).reshape(n, width))
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


def _probe_each(t: Table, keys: Keys, todo: list[int], start: list[int], out: np.ndarray,
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
                if row[0] == EMPTY:
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


def insert(t: Table, keys: Keys, seqs, offsets, lengths, expires) -> None:
    """Place keys that need a slot: rounds of one winner per free slot; the others probe on."""
    slot = t.home(keys)
    lens, tails = keys.lens_array(), keys.tail_array()
    values = np.empty((keys.n, 3), np.uint64)     # the hot row after the state word
    values[:, 0], values[:, 1], values[:, 2] = keys.w0, keys.w1, np.asarray(expires, np.float64).view(np.uint64)
    todo = np.arange(keys.n)
    while todo.size:
        s = slot[todo]
        st = t.state[s]
        free = (st == EMPTY) | (st == TOMB)
        won_slots, first = np.unique(s[free], return_index=True)
        won = todo[free][first]
        t.used += int((t.state[won_slots] == EMPTY).sum())
        t.tail[won_slots] = tails[won]
        t.seq[won_slots] = seqs[won]
        t.offset[won_slots] = offsets[won]
        t.length[won_slots] = lengths[won]
        t.hot[won_slots, W0:] = values[won]
        t.state[won_slots] = lens[won]             # last: the slot becomes visible
        placed = np.zeros(keys.n, bool)
        placed[won] = True
        todo = todo[~placed[todo]]
        slot[todo] = (slot[todo] + 1) & t.mask
