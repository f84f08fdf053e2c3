"""BlockIndex (numpy open addressing) against a plain dict model: random puts, replacements, drops
and growth; longest prefix with expiry; keys of every allowed length; tables near half full (long
probe sequences); key parsing; lookups racing a writer."""
from __future__ import annotations

import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.index import BlockIndex, Location
from kvstore.indexkeys import Keys


def model_put(model: dict, key: bytes, loc: Location) -> bool:
    old = model.get(key)
    if old is not None and (old.expires_at, old.seq) >= (loc.expires_at, loc.seq):
        return False
    model[key] = loc
    return True


def same(a: Location | None, b: Location | None) -> bool:
    if a is None or b is None:
        return a is b
    return (a.seq, a.offset, a.length, a.expires_at) == (b.seq, b.offset, b.length, b.expires_at)


def test_random_operations_match_a_dict_model():
    rng = random.Random(1)
    index, model = BlockIndex(), {}
    keys = [rng.randbytes(rng.choice((16, 16, 16, 1, 7, 32))) for _ in range(3000)]
    for step in range(60):
        batch = rng.sample(keys, rng.randrange(1, 400))
        locs = [Location(rng.randrange(20), rng.randrange(64, 10**9), rng.randrange(48, 10**6),
                         float(rng.randrange(1000, 1100))) for _ in batch]
        taken = 0
        dedup: dict[bytes, Location] = {}
        for k, loc in zip(batch, locs):   # within one call the record expiring last wins
            if k not in dedup or (loc.expires_at, loc.seq) > (dedup[k].expires_at, dedup[k].seq):
                dedup[k] = loc
        for k, loc in dedup.items():
            taken += model_put(model, k, loc)
        assert index.put_many(batch, [x.seq for x in locs], [x.offset for x in locs], [x.length for x in locs],
                              [x.expires_at for x in locs]) == taken
        if step % 7 == 3:
            seq = rng.randrange(20)
            gone = [k for k, loc in model.items() if loc.seq == seq]
            assert index.drop_segment(seq) == len(gone)
            for k in gone:
                del model[k]
        if step % 5 == 1 and model:
            k = rng.choice(list(model))
            assert index.drop_key(k, model[k].seq, model[k].offset + 1) is False
            assert index.drop_key(k, model[k].seq, model[k].offset) is True
            del model[k]
        assert len(index) == len(model)
        probe = rng.sample(keys, 500)
        assert all(same(a, model.get(k)) for a, k in zip(index.get_many(probe), probe))
    assert {k: (v.seq, v.offset) for k, v in index.items()} == {k: (v.seq, v.offset) for k, v in model.items()}


def test_longest_prefix_stops_at_the_first_absent_or_expired_block():
    index = BlockIndex()
    chain = [bytes([i]) * 16 for i in range(1, 101)]
    index.put_many(chain, [0] * 100, range(64, 164), [100] * 100, [2000.0] * 100)
    assert index.longest_prefix(chain, 1000.0) == 100
    assert index.longest_prefix(chain + [b"x" * 16], 1000.0) == 100
    assert index.longest_prefix([], 1000.0) == 0
    index.drop_key(chain[40], 0, 64 + 40)
    assert index.longest_prefix(chain, 1000.0) == 40
    index.put_many(chain[:30], [1] * 30, range(30), [100] * 30, [3000.0] * 30)   # re-written: live longer
    assert index.longest_prefix(chain, 2500.0) == 30                               # the rest expired
    assert [loc.seq for loc in index.prefix_locations(chain, 1000.0)][28:32] == [1, 1, 0, 0]
    assert index.put(chain[5], Location(0, 64, 100, 1999.0)) is False               # older: ignored
    assert index.get(chain[5]).expires_at == 3000.0


def test_the_table_grows_and_keeps_every_entry():
    index = BlockIndex()
    keys = [i.to_bytes(16, "little") for i in range(50_000)]   # sequential keys: hashing must spread them
    for start in range(0, len(keys), 5000):
        part = keys[start:start + 5000]
        index.put_many(part, [start] * len(part), range(len(part)), [1] * len(part), [10.0] * len(part))
    assert len(index) == 50_000 and index.longest_prefix(keys, 0.0) == 50_000
    assert index.drop_segments([0, 5000]) == 10_000 and index.longest_prefix(keys, 0.0) == 0
    assert index.longest_prefix(keys[10_000:], 0.0) == 40_000


def test_keys_outside_1_to_32_bytes_are_refused():
    index = BlockIndex()
    for bad in ([b""], [bytes(33)], [bytes(16), bytes(40)]):
        with pytest.raises(ValueError):
            index.get_many(bad)


def test_lookups_racing_a_writer_always_see_whole_entries():
    index = BlockIndex()
    keys = [random.Random(2).randbytes(12) + i.to_bytes(4, "little") for i in range(6000)]
    stop = threading.Event()
    errors, looks = [], [0]

    def look():
        while not stop.is_set():
            try:
                hit = index.longest_prefix(keys, 0.0)
                for loc in index.prefix_locations(keys[max(0, hit - 50):hit], 0.0):
                    assert loc.offset == loc.length * 3   # written together: never half an entry
                looks[0] += 1
            except Exception as exc:   # pragma: no cover - reported below
                errors.append(exc)
                return

    reader = threading.Thread(target=look)
    reader.start()
    try:
        for start in range(0, len(keys), 200):   # grows the table several times meanwhile
            part = range(start, start + 200)
            index.put_many(keys[start:start + 200], [1] * 200, [3 * i for i in part], list(part), [5.0] * 200)
            if start % 1000 == 0:   # re-publish some with a later expiry: new slots, old ones freed
                index.put_many(keys[:100], [2] * 100, [3 * i for i in range(100)], list(range(100)), [6.0] * 100)
    finally:
        stop.set()
        reader.join()
    assert errors == [] and looks[0] > 0 and index.longest_prefix(keys, 0.0) == 6000


# ---- the probe rounds, the key parsing and readers during changes --------------------------------
def oracle_prefix(model: dict, chain: list, now: float) -> list:
    out = []
    for k in chain:
        loc = model.get(k)
        if loc is None or loc.expires_at <= now:
            break
        out.append(loc)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_full_tables_with_tombstones_match_a_dict_model(seed):
    """Tables kept near half full (long probe sequences, wrapping at the table's end, several probe
    rounds and the one-by-one tail), keys of every length, drops and re-publishes leaving tombstones,
    growth; every lookup checked against a dict."""
    rng = random.Random(100 + seed)
    index, model = BlockIndex(), {}
    lengths = (16,) * 6 + (1, 2, 15, 17, 31, 32) if seed % 2 else (16,)
    pool = [rng.randbytes(rng.choice(lengths)) for _ in range(4000)]
    if seed % 2:   # long keys sharing their first 16 bytes and length: same home, told apart by the rest
        heads = [rng.randbytes(16) for _ in range(10)]
        pool[::4] = [rng.choice(heads) + rng.randbytes(rng.choice((1, 16))) for _ in pool[::4]]
        pool = list(dict.fromkeys(pool))
    for step in range(40):
        target = [1000, 2000, 4000][step // 14]   # stop just short of each growth: ~half full
        batch = rng.sample(pool[:target], rng.randrange(1, 300))
        locs = [Location(rng.randrange(8), rng.randrange(10**9), rng.randrange(1, 10**6), float(rng.randrange(90, 110)))
                for _ in batch]
        for k, loc in zip(batch, locs):
            if len(model) < 0.45 * (index._t.mask + 1) or k in model:
                index.put(k, loc)
                model_put(model, k, loc)
        if step % 3 == 0:   # tombstones: drop a segment, drop single keys
            seq = rng.randrange(8)
            gone = [k for k, loc in model.items() if loc.seq == seq]
            assert index.drop_segment(seq) == len(gone)
            for k in gone:
                del model[k]
        for k in rng.sample(sorted(model), min(5, len(model))):
            assert index.drop_key(k, model[k].seq, model[k].offset)
            del model[k]
        assert len(index) == len(model)
        probe = rng.sample(pool, 600)
        assert all(same(a, model.get(k)) for a, k in zip(index.get_many(probe), probe))
        present = list(model)
        for _ in range(20):   # chains: present keys, then an absent, expired or present one, then more
            chain = rng.sample(present, min(len(present), rng.randrange(1, 200)))
            chain.insert(rng.randrange(len(chain) + 1), rng.choice(pool))
            now = rng.choice((0.0, 95.0, 105.0))
            want = oracle_prefix(model, chain, now)
            assert index.longest_prefix(chain, now) == len(want)
            assert all(same(a, b) for a, b in zip(index.prefix_locations(chain, now), want))
    assert sorted(k for k, _ in index.items()) == sorted(model)


def test_keys_that_only_add_up_to_16_bytes_each_are_kept_apart():
    """Two 16-byte keys and a 15- plus a 17-byte key can join to the same bytes: the lengths decide."""
    index = BlockIndex()
    for fill in (b"\0", b"\1", b"\xff"):
        odd = [fill * 15, fill * 17]
        even = [fill * 16, fill * 16]
        index.put_many(odd, [1, 1], [10, 20], [1, 1], [50.0, 50.0])
        assert [loc.offset for loc in index.get_many(odd)] == [10, 20]
        assert index.get_many(even) == [None, None]
        assert index.longest_prefix(odd, 0.0) == 2 and index.longest_prefix(even, 0.0) == 0
        assert index.longest_prefix([fill * 16] + odd, 0.0) == 0
        index.clear()


@given(st.lists(st.binary(min_size=1, max_size=32), max_size=40))
@settings(max_examples=200, deadline=None)
def test_key_columns_hold_the_zero_padded_bytes(keys):
    k = Keys(keys)
    padded = b"".join(key.ljust(32, b"\0") for key in keys)
    assert k.n == len(keys)
    assert k.words.tobytes() == b"".join(padded[i:i + 16] for i in range(0, len(padded), 32))
    assert k.tail_array().tobytes() == b"".join(padded[i + 16:i + 32] for i in range(0, len(padded), 32))
    assert k.lens_array().tolist() == [len(key) for key in keys]


def test_readers_always_see_keys_that_do_not_change_while_others_do():
    """While the writer grows the table, re-publishes and drops other keys (tombstones, reused
    slots), every lookup still finds each untouched key with its own location."""
    rng = random.Random(5)
    index = BlockIndex()
    stable = [rng.randbytes(16) for _ in range(300)]
    index.put_many(stable, [7] * 300, range(300), [3] * 300, [1e9] * 300)
    churn = [rng.randbytes(rng.choice((16, 16, 9, 32))) for _ in range(20_000)]
    stop = threading.Event()
    errors, looks = [], [0]

    def look():
        while not stop.is_set():
            try:
                assert index.longest_prefix(stable, 0.0) == 300
                locs = index.prefix_locations(stable[100:], 0.0)
                assert [(x.seq, x.offset) for x in locs] == [(7, i) for i in range(100, 300)]
                mixed = rng.sample(churn, 50) + stable[:50]
                assert [x.offset for x in index.get_many(mixed)[50:]] == list(range(50))
                looks[0] += 1
            except Exception as exc:   # pragma: no cover - reported below
                errors.append(exc)
                return

    reader = threading.Thread(target=look)
    reader.start()
    try:
        for start in range(0, len(churn), 500):
            part = churn[start:start + 500]
            index.put_many(part, [1] * len(part), range(len(part)), [1] * len(part), [5.0] * len(part))
            again = churn[:start + 500:3]   # re-published: new slots, old ones tombstoned
            index.put_many(again, [2] * len(again), range(len(again)), [1] * len(again), [6.0] * len(again))
            index.drop_segment(1)
    finally:
        stop.set()
        reader.join()
    assert errors == [] and looks[0] > 0
