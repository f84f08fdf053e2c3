"""SegmentStore: bit-exact round trips, longest-prefix lookup, TTL per traffic class, refresh, time
slices, rotation, gc, capacity eviction, restart, corruption and torn tails, bad input."""
from __future__ import annotations

import os

import numpy as np
import pytest
from structlog.testing import capture_logs

from kvstore import SegmentStore, StoreError, StoreLocked, StoreSettings
from kvstore import record as fmt
from kvstore.fileio import PosixIO
from kvstore.segment import segment_path
from messages.common import TrafficClass
from messages.errors import InvalidRequest
from messages.tensors import TensorDesc
from tests.kvstore.common import DAY, T0, Clock, bf16_page, chain, open_store, page_for, pages_of, same_bits

AGENT, CHATBOT = TrafficClass.AGENT, TrafficClass.CHATBOT


def segment_files(root) -> list[str]:
    return sorted(n for n in os.listdir(root / "segments") if n.endswith(".kvs"))


def flip_bit(path: str, offset: int, bit: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def test_round_trip_is_bit_exact_for_bf16_pages_and_keeps_dtype_and_shape(tmp_path):
    keys = chain(6)
    rng = np.random.default_rng(0)
    special = np.array([np.nan, -0.0, np.inf, -np.inf, 1e-40, 3.0], np.float32).view(np.uint32) >> 16   # bf16 bits
    fp8 = TensorDesc("float8_e4m3fn", (64,)), memoryview(rng.integers(0, 256, 64, dtype=np.uint8))
    pages = [(keys[0], page_for(keys[0])), (keys[1], bf16_page(special)),
             (keys[2], bf16_page(rng.integers(0, 1 << 16, (4, 33)))),
             (keys[3], rng.standard_normal((7, 5), np.float32)), (keys[4], np.arange(100, dtype=np.uint8)), (keys[5], fp8)]
    with open_store(tmp_path) as store:
        assert store.write(pages, CHATBOT, "v4/bf16").written == 6
        back = store.read(keys)
    assert len(back) == 6
    for (_, sent), got in zip(pages, back):
        assert same_bits(sent, got)


def test_pages_already_stored_are_skipped(tmp_path):
    keys = chain(4)
    with open_store(tmp_path) as store:
        assert store.write(pages_of(keys[:2])).written == 2
        result = store.write(pages_of(keys) + pages_of(keys[3:]))   # the last one twice in one call
        assert (result.written, result.skipped) == (2, 3)
        assert len(store) == 4 and store.stats.records_written == 4


def test_longest_prefix_counts_leading_present_unexpired_blocks(tmp_path):
    keys = chain(10)
    with open_store(tmp_path) as store:
        store.write(pages_of(keys[:4] + keys[5:8]))
        assert store.lookup(keys) == 4                         # block 4 is missing: the prefix ends there
        assert store.lookup(keys[5:8]) == 3
        assert store.lookup([]) == 0 and store.lookup(chain(3, seed=9)) == 0
        assert store.lookup(keys[:4] + chain(2, seed=7)) == 4
        locations = store.locations(keys)
        assert len(locations) == 4 and all(fmt.parse_location(text)[0] == 0 for text in locations)
        assert [desc for desc, _ in store.read(keys)] == [page_for(k)[0] for k in keys[:4]]
        assert store.read(keys, prefix=False)[4] is None
        assert store.stats.lookups == 5 and store.stats.lookup_hits == 4 + 3 + 0 + 0 + 4


def test_ttl_follows_the_traffic_class(tmp_path):
    clock = Clock()
    agent, chatbot = chain(3, seed=1), chain(3, seed=2)
    with open_store(tmp_path, clock) as store:
        store.write(pages_of(agent), AGENT)
        store.write(pages_of(chatbot), CHATBOT)
        clock.advance(3 * DAY - 1)
        assert (store.lookup(agent), store.lookup(chatbot)) == (3, 3)
        clock.advance(1)
        assert (store.lookup(agent), store.lookup(chatbot)) == (0, 3)
        assert store.read(agent) == [] and store.read(agent, prefix=False) == [None] * 3
        clock.advance(4 * DAY)
        assert store.lookup(chatbot) == 0


def test_ttls_are_configurable(tmp_path):
    clock = Clock()
    keys = chain(2)
    with open_store(tmp_path, clock, ttl_s={"agent": 60.0}) as store:
        assert store.settings.ttl_s == {"agent": 60.0, "chatbot": 7 * DAY}
        store.write(pages_of(keys), AGENT)
        clock.advance(60)
        assert store.lookup(keys) == 0
    for bad in ({"robot": 5.0}, {"agent": 0}, {"chatbot": float("inf")}):
        with pytest.raises(ValueError):
            StoreSettings(root=str(tmp_path), ttl_s=bad)


def test_a_block_near_expiry_is_written_again_and_lives_longer(tmp_path):
    clock = Clock()
    keys = chain(2)
    with open_store(tmp_path, clock, ttl_s={"agent": 100.0}) as store:
        store.write(pages_of(keys), AGENT)
        clock.advance(40)                                       # 60% of the TTL left: skipped
        assert store.write(pages_of(keys), AGENT).skipped == 2
        clock.advance(20)                                       # 40% left: a fresh copy
        assert store.write(pages_of(keys[:1]), AGENT).written == 1
        clock.advance(50)
        assert store.lookup(keys) == 1
        assert same_bits(store.read(keys)[0], page_for(keys[0]))


def test_records_of_different_expiry_windows_share_no_segment(tmp_path):
    clock = Clock(T0 - T0 % 3600 + 100)                        # 100 s into an hour window
    with open_store(tmp_path, clock, slice_s=3600.0) as store:
        store.write(pages_of(chain(2, seed=1)), AGENT)
        store.write(pages_of(chain(2, seed=2)), CHATBOT)
        clock.advance(600)
        store.write(pages_of(chain(2, seed=3)), AGENT)          # same hour window: same segment
        assert store.segment_count == 2
        clock.advance(3600)
        store.write(pages_of(chain(2, seed=4)), AGENT)          # next window: a new segment
        assert store.segment_count == 3


def test_segments_rotate_once_full(tmp_path):
    keys = chain(40)
    with open_store(tmp_path, segment_bytes=64 << 10) as store:   # ~15 pages of 4 KiB each
        store.write(pages_of(keys))
        assert store.segment_count == 3
        assert all(os.path.getsize(tmp_path / "segments" / n) <= 64 << 10 for n in segment_files(tmp_path)[:-1])
        assert store.lookup(keys) == 40
        assert all(same_bits(p, page_for(k)) for p, k in zip(store.read(keys), keys))


def test_gc_drops_whole_segments_once_every_record_expired(tmp_path):
    clock = Clock()
    agent, chatbot = chain(3, seed=1), chain(3, seed=2)
    with open_store(tmp_path, clock, slice_s=3600.0) as store:
        store.write(pages_of(agent), AGENT)
        store.write(pages_of(chatbot), CHATBOT)
        assert len(segment_files(tmp_path)) == 2
        clock.advance(3 * DAY - 1)
        assert store.gc() == 0
        clock.advance(1)
        assert store.lookup(agent) == 0 and store.gc() == 1
        assert len(segment_files(tmp_path)) == 1 and len(store) == 3
        assert store.stats.segments_expired == 1 and store.stats.records_expired == 3
        assert store.lookup(chatbot) == 3
        clock.advance(4 * DAY)
        assert store.gc() == 1 and segment_files(tmp_path) == [] and store.bytes_stored == 0


def test_capacity_evicts_the_oldest_segments(tmp_path):
    with open_store(tmp_path, segment_bytes=64 << 10, capacity_bytes=192 << 10) as store:
        chains = [chain(10, seed=s) for s in range(8)]         # ~41 KiB each: one segment per chain
        for keys in chains:
            store.write(pages_of(keys))
            assert store.bytes_stored <= 192 << 10
        assert store.stats.segments_evicted > 0
        assert store.lookup(chains[0]) == 0
        assert store.lookup(chains[-1]) == 10 and store.lookup(chains[-2]) == 10
        assert store.stats.records_evicted == sum(1 for c in chains for k in c) - len(store)
        total = sum(os.path.getsize(tmp_path / "segments" / n) for n in segment_files(tmp_path))
        assert total == store.bytes_stored


def test_restart_rebuilds_the_same_index_from_the_sealed_segments(tmp_path):
    clock = Clock()
    keys = chain(30)
    with open_store(tmp_path, clock, segment_bytes=64 << 10) as store:
        store.write(pages_of(keys[:20]), AGENT)
        store.write(pages_of(keys[20:]), CHATBOT)
        before = {k: store.locations([k]) for k in keys}
    with open_store(tmp_path, clock, segment_bytes=64 << 10) as store:
        assert store.stats.segments_recovered == 0
        assert {k: store.locations([k]) for k in keys} == before
        assert all(same_bits(p, page_for(k)) for p, k in zip(store.read(keys), keys))
        store.write(pages_of(chain(2, seed=5)))                 # new records go to a new segment
        assert max(fmt.parse_location(t)[0] for t in store.locations(chain(2, seed=5))) == 3


def _crash(store: SegmentStore) -> None:
    """Leave the store as a killed process would: open segments unsealed, lock released."""
    for seg in store.space.open.values():
        seg.close()
    store._log.close()
    os.close(store._lock_fd)
    store._closed = True


def test_a_torn_tail_record_is_cut_at_restart_and_never_served(tmp_path):
    keys = chain(6)
    store = open_store(tmp_path)
    store.write(pages_of(keys[:5]))
    _crash(store)
    path = segment_path(str(tmp_path), 0)
    header = fmt.encode_record_header(keys[5], 0, T0 + DAY, T0, "bfloat16", (100,), "", bytes(200))
    with open(path, "ab") as f:                                  # a record cut off mid-payload
        f.write(header + bytes(150))
    with capture_logs() as logs, open_store(tmp_path) as store:
        assert store.stats.segments_recovered == 1
        assert store.lookup(keys) == 5
        assert all(same_bits(p, page_for(k)) for p, k in zip(store.read(keys), keys[:5]))
    recovered = [e for e in logs if e["event"] == "kv_store.segment_recovered"]
    assert recovered and recovered[0]["records"] == 5 and recovered[0]["cut_bytes"] == len(header) + 150
    with open_store(tmp_path) as store:                           # sealed now: read from its footer
        assert store.stats.segments_recovered == 0 and store.lookup(keys) == 5


def test_an_unsealed_segment_is_verified_record_by_record_at_restart(tmp_path):
    keys = chain(6)
    store = open_store(tmp_path)
    store.write(pages_of(keys))
    bad = fmt.parse_location(store.locations(keys)[3])
    _crash(store)
    flip_bit(segment_path(str(tmp_path), 0), bad[1] + bad[2] - 10)   # inside record 3's payload
    with open_store(tmp_path) as store:
        assert store.lookup(keys) == 3                           # the scan stops at the corrupt record
        assert len(store) == 3


def test_a_segment_file_shorter_than_its_header_is_removed_at_restart(tmp_path):
    """The writer died between creating a segment file and writing its header: no record is in it,
    and its number is not handed out again."""
    keys = chain(3)
    store = open_store(tmp_path)
    store.write(pages_of(keys))
    _crash(store)
    for seq, size in ((1, 0), (2, fmt.SEGMENT_HEADER_SIZE // 2)):
        with open(segment_path(str(tmp_path), seq), "wb") as f:
            f.write(bytes(size))
    with open_store(tmp_path) as store:
        assert segment_files(tmp_path) == [fmt.segment_name(0)]
        assert store.stats.segments_recovered == 3 and store.lookup(keys) == 3   # (segment 0 was unsealed)
        store.write(pages_of(chain(1, seed=7)))
        assert fmt.parse_location(store.locations(chain(1, seed=7))[0])[0] == 3


def test_a_flipped_payload_bit_is_a_miss_never_served(tmp_path):
    keys = chain(5)
    with open_store(tmp_path) as store:
        store.write(pages_of(keys))
        seq, offset, length = fmt.parse_location(store.locations(keys)[2])
        flip_bit(segment_path(str(tmp_path), seq), offset + length - 1, bit=7)
        with capture_logs() as logs:
            pages = store.read(keys)
            assert len(pages) == 2                               # the prefix stops before the bad block
            scattered = store.read(keys, prefix=False)
        assert scattered[2] is None and all(p is not None for i, p in enumerate(scattered) if i != 2)
        assert any(e["event"] == "kv_store.read_miss" and "checksum" in e["reason"] for e in logs)
        assert store.stats.corrupt_records == 2
        store.gc()                                               # the writer forgets the corrupt record
        assert store.lookup(keys) == 2
        assert store.write(pages_of(keys)).written == 1          # and takes a fresh copy
        assert all(same_bits(p, page_for(k)) for p, k in zip(store.read(keys), keys))


def test_a_flipped_header_bit_is_a_miss(tmp_path):
    keys = chain(3)
    with open_store(tmp_path) as store:
        store.write(pages_of(keys))
        seq, offset, _ = fmt.parse_location(store.locations(keys)[1])
        flip_bit(segment_path(str(tmp_path), seq), offset + 30)  # inside expires_at
        assert len(store.read(keys)) == 1 and store.stats.corrupt_records == 1


def test_bad_input_is_refused_before_anything_is_written(tmp_path):
    keys = chain(2)
    with open_store(tmp_path) as store:
        for pages, tc in (([(keys[0], page_for(keys[0])), (b"", page_for(keys[1]))], CHATBOT),
                          ([(keys[0], page_for(keys[0])), (bytes(33), page_for(keys[1]))], CHATBOT),
                          ([(keys[0], page_for(keys[0])), (keys[1], np.zeros((4, 4), np.float32).T)], CHATBOT),
                          ([(keys[0], page_for(keys[0]))], 7)):
            with pytest.raises(InvalidRequest):
                store.write(pages, tc)
        with pytest.raises(InvalidRequest):
            store.write(pages_of(keys), CHATBOT, layout="x" * 300)
        assert len(store) == 0 and store.bytes_stored == 0


def test_a_second_writer_on_the_same_directory_is_refused(tmp_path):
    with open_store(tmp_path):
        with pytest.raises(StoreLocked):
            open_store(tmp_path)
    open_store(tmp_path).close()


@pytest.mark.parametrize("policy,syncs", [("none", 0), ("batch", 2), ("always", 6)])
def test_fsync_policy_decides_when_segments_are_synced(tmp_path, policy, syncs):
    class CountingIO(PosixIO):
        synced = 0

        def fsync(self, fd):
            CountingIO.synced += 1
            super().fsync(fd)

    store = SegmentStore(StoreSettings(root=str(tmp_path), fsync=policy), clock=Clock(), io=CountingIO())
    store.write(pages_of(chain(3, seed=1)))
    store.write(pages_of(chain(3, seed=2)))
    assert CountingIO.synced == syncs
    store.close()
    assert store.lookup(chain(3, seed=1)) == 3


def test_an_io_error_mid_batch_publishes_only_whole_records(tmp_path):
    class FailingIO(PosixIO):
        writes = 0

        def pwrite(self, fd, offset, buffers):
            FailingIO.writes += 1
            if FailingIO.writes == 4:                            # segment header, 2 records, then fail
                os.pwritev(fd, [memoryview(buffers[0])[:20]], offset)
                raise OSError(28, "No space left on device")
            return super().pwrite(fd, offset, buffers)

    keys = chain(5)
    store = SegmentStore(StoreSettings(root=str(tmp_path)), clock=Clock(), io=FailingIO())
    with pytest.raises(StoreError):
        store.write(pages_of(keys))
    assert store.lookup(keys) == 2 and store.stats.write_errors == 1
    store.close()
    with open_store(tmp_path) as again:
        assert again.lookup(keys) == 2
        assert all(same_bits(p, page_for(k)) for p, k in zip(again.read(keys), keys))


def test_settings_are_validated(tmp_path):
    for bad in ({"backend": "s3"}, {"fsync": "sometimes"}, {"segment_bytes": 100},
                {"capacity_bytes": 1 << 20, "segment_bytes": 2 << 20}, {"slice_s": 0},
                {"refresh_fraction": 2}, {"max_open_segments": 0}):
        with pytest.raises(ValueError):
            StoreSettings(root=str(tmp_path), **bad)
