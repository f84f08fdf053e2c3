"""StoreReader: another process's view of the store, from the index log the writer publishes."""
from __future__ import annotations

import os

from kvstore import StoreReader
from kvstore import record as fmt
from kvstore.indexlog import IndexLogTail
from kvstore.segment import segment_path
from messages.common import TrafficClass
from tests.kvstore.common import DAY, Clock, chain, open_store, page_for, pages_of, same_bits
from tests.kvstore.test_store import flip_bit


def newest_log(root) -> str:
    return str(root / sorted(n for n in os.listdir(root) if n.endswith(".log"))[-1])


def test_reader_sees_what_the_writer_publishes_and_reads_it_bit_exact(tmp_path):
    keys = chain(12)
    with open_store(tmp_path) as store:
        reader = StoreReader(str(tmp_path))
        assert len(reader) == 0
        store.write(pages_of(keys[:5]))
        assert reader.lookup(keys) == 5                  # lookups look at the log first
        store.write(pages_of(keys[5:]), layout="v4")
        assert reader.refresh() == 7
        pages = reader.read(keys)
        assert len(pages) == 12 and all(same_bits(p, page_for(k)) for p, k in zip(pages, keys))
        assert len(reader.read(keys, layout="v4")) == 0  # the first blocks were stored without that layout
        assert reader.read(keys, prefix=False, layout="v4")[5:] != [None] * 7
        reader.close()


def test_reader_follows_gc_and_eviction(tmp_path):
    clock = Clock()
    agent, chatbot = chain(3, seed=1), chain(3, seed=2)
    with open_store(tmp_path, clock) as store:
        store.write(pages_of(agent), TrafficClass.AGENT)
        store.write(pages_of(chatbot), TrafficClass.CHATBOT)
        reader = StoreReader(str(tmp_path), clock=clock)
        assert len(reader) == 6
        clock.advance(3 * DAY)
        store.gc()
        reader.refresh()
        assert len(reader) == 3 and reader.lookup(chatbot) == 3


def test_a_segment_deleted_under_the_reader_is_a_miss(tmp_path):
    clock = Clock()
    keys = chain(3)
    with open_store(tmp_path, clock) as store:
        store.write(pages_of(keys), TrafficClass.AGENT)
        reader = StoreReader(str(tmp_path), clock=clock, refresh_interval_s=3600)
        clock.advance(3 * DAY)
        store.gc()
        assert len(reader) == 3                          # it has not looked at the log since
        assert reader.read(keys, now=clock.now - 10) == []


def test_reader_starts_over_from_each_new_generation(tmp_path):
    keys = chain(4)
    with open_store(tmp_path) as store:
        store.write(pages_of(keys[:2]))
    reader = StoreReader(str(tmp_path))
    first = reader.generation
    with open_store(tmp_path) as store:
        store.write(pages_of(keys[2:]))
        assert reader.lookup(keys) == 4 and reader.generation == first + 1
        assert [n for n in os.listdir(tmp_path) if n.endswith(".log")] == [fmt.log_name(first + 1)]


def test_reader_never_serves_a_corrupt_record_and_forgets_it(tmp_path):
    keys = chain(4)
    with open_store(tmp_path) as store:
        store.write(pages_of(keys))
        reader = StoreReader(str(tmp_path))
        seq, offset, length = fmt.parse_location(store.locations(keys)[1])
        flip_bit(segment_path(str(tmp_path), seq), offset + length - 100, bit=3)
        assert len(reader.read(keys)) == 1
        assert reader.corrupt_records == 1 and reader.lookup(keys) == 1
        store.read(keys)                                 # the writer finds it too, and forgets it
        store.gc()                                       # (publishing a DROP_KEY)
        other = StoreReader(str(tmp_path))
        assert other.lookup(keys) == 1


def test_reads_by_location_verify_key_and_checksums(tmp_path):
    keys = chain(3)
    with open_store(tmp_path) as store:
        store.write(pages_of(keys))
        locations = store.locations(keys)
    reader = StoreReader(str(tmp_path))
    pages = reader.read_locations(locations, keys)
    assert all(same_bits(p, page_for(k)) for p, k in zip(pages, keys))
    swapped = reader.read_locations(locations, [keys[1], keys[0], keys[2]])
    assert swapped[0] is None and swapped[1] is None and swapped[2] is not None
    assert reader.read_locations(["nonsense", "0:10:5", "99:64:4096"]) == [None, None, None]


def test_the_log_tail_waits_for_a_partial_entry_and_skips_a_corrupt_one(tmp_path):
    keys = chain(3)
    with open_store(tmp_path) as store:
        store.write(pages_of(keys[:1]))
    path = newest_log(tmp_path)
    tail = IndexLogTail(str(tmp_path))
    new = lambda: [fmt.entry_key(e) for e in tail.poll()[1]]   # noqa: E731
    assert new() == [keys[0]]
    entry = fmt.encode_entry(fmt.Entry(fmt.PUT, 0, 64, 100, 1e12, keys[1]))
    with open(path, "ab") as f:
        f.write(entry[:40])
    assert new() == []
    with open(path, "ab") as f:
        f.write(entry[40:])
    assert new() == [keys[1]]
    bad = bytearray(fmt.encode_entry(fmt.Entry(fmt.PUT, 0, 64, 100, 1e12, keys[2])))
    bad[20] ^= 1
    with open(path, "ab") as f:
        f.write(bytes(bad) + entry)
    assert new() == [] and new() == []       # maybe still being written: wait
    assert new() == [keys[1]]                # stayed bad with data behind it: skipped
    tail.close()


def test_the_writer_compacts_its_log_into_a_new_generation(tmp_path, monkeypatch):
    clock = Clock()
    with open_store(tmp_path, clock, segment_bytes=16 << 10) as store:
        reader = StoreReader(str(tmp_path), clock=clock)
        generation = reader.generation
        for seed in range(6):
            store.write(pages_of(chain(3, seed=seed)), TrafficClass.AGENT)
        store.write(pages_of(chain(2, seed=99)), TrafficClass.CHATBOT)
        clock.advance(3 * DAY)
        monkeypatch.setattr("kvstore.store.LOG_COMPACT_SLACK", 0)
        store.gc()
        assert reader.lookup(chain(2, seed=99)) == 2 and len(reader) == 2
        assert reader.generation == generation + 1
