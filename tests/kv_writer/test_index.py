"""BlockIndex (numpy open addressing) against a plain dict model: random puts, replacements, drops
and growth; longest prefix with expiry; keys of every allowed length; lookups racing a writer."""
from __future__ import annotations

import random
import threading

import pytest

from services.kv_writer.index import BlockIndex, Location


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
