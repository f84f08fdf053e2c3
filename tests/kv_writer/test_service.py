"""KvWriterService over real ZeroMQ: write / lookup / read round trips, direct reads by a worker,
writes answered only on error or when an ack is asked, typed errors, bounded pending writes, the per-reply byte limit, file I/O off the event loop, gc,
metrics, restart and a clean stop."""
from __future__ import annotations

import asyncio
import threading
import time
from contextlib import asynccontextmanager

import pytest

from kvstore import SegmentStore, StoreReader, StoreSettings
from messages.common import TrafficClass
from messages.control import ServiceState, StatusQuery
from messages.errors import ErrorCode, RemoteError, RequestTimeout
from messages.kv_store import KvLookup, KvLookupReply, KvPages, KvReadPages, KvWriteAck, KvWritePages
from services.catalog import resolve
from services.kv_writer.service import KvWriterService
from services.runtime.config import ServiceConfig
from services.runtime.service import Service
from tests.kvstore.common import DAY, Clock, chain, page_for, same_bits


async def eventually(predicate, timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s")
        await asyncio.sleep(0.01)


@asynccontextmanager
async def running(tmp_path, settings=None, clock=time.time):
    store_root = str(tmp_path / "store")
    writer = KvWriterService(ServiceConfig(kind="kv_writer", instance="kv", bind=f"ipc://{tmp_path}/kv.sock",
                                           settings={"root": store_root, **(settings or {})}), clock=clock)
    client = Service(ServiceConfig(kind="echo", instance="c", bind=f"ipc://{tmp_path}/c.sock"))
    tasks = [asyncio.create_task(writer.run(install_signals=False)),
             asyncio.create_task(client.run(install_signals=False))]
    try:
        await eventually(lambda: client.state == ServiceState.RUNNING, what="client running")
        address = writer.config.advertise
        deadline = time.monotonic() + 10.0
        while True:   # ready when the writer answers a StatusQuery as RUNNING
            try:
                if (await client.call(address, StatusQuery(), timeout=0.5)).message.state == ServiceState.RUNNING:
                    break
            except RequestTimeout:
                pass
            assert time.monotonic() < deadline, "kv writer never became ready"
            await asyncio.sleep(0.01)
        yield writer, client, address
    finally:
        writer.stop()
        client.stop()
        assert await asyncio.gather(*tasks) == [0, 0]


def write_message(keys, tc=TrafficClass.CHATBOT, ack=True):
    return KvWritePages(keys, list(range(len(keys))), "v4", tc, ack), [page_for(k) for k in keys]


def sample(writer: KvWriterService, name: str) -> float:
    return writer.metrics.registry.get_sample_value(name, {"kind": "kv_writer", "instance": "kv"})


async def test_write_lookup_read_round_trip_and_a_worker_reads_the_files_directly(tmp_path):
    keys = chain(6)
    async with running(tmp_path) as (writer, client, address):
        msg, pages = write_message(keys[:4])
        assert (await client.call(address, msg, buffers=pages)).message == KvWriteAck(4, 0)
        msg, pages = write_message(keys)
        assert (await client.call(address, msg, buffers=pages)).message == KvWriteAck(2, 4)
        reply = (await client.call(address, KvLookup(keys + chain(2, seed=5)))).message
        assert reply.hit_blocks == 6 and len(reply.locations) == 6
        assert (await client.call(address, KvLookup(keys, with_locations=False))).message == KvLookupReply(6)
        env = await client.call(address, KvReadPages(keys[:3] + chain(1, seed=9) + keys[3:]))
        assert env.message == KvPages(3, [0, 1, 2])
        assert all(same_bits(env.frame(i), page_for(k)) for i, k in enumerate(keys[:3]))
        assert (await client.call(address, KvReadPages(keys, layout="other"))).message.found == 0
        with StoreReader(writer.store.root) as reader:   # a prefill worker, no service in between
            direct = reader.read_locations(reply.locations, keys)
            assert all(same_bits(p, page_for(k)) for p, k in zip(direct, keys))
            assert reader.lookup(keys) == 6


async def test_a_write_without_ack_is_stored_and_not_answered(tmp_path):
    keys = chain(3)
    async with running(tmp_path) as (writer, client, address):
        msg, pages = write_message(keys, ack=False)
        with pytest.raises(RequestTimeout):
            await client.call(address, msg, buffers=pages, timeout=0.5)
        assert (await client.call(address, KvLookup(keys))).message.hit_blocks == 3


@pytest.mark.parametrize("bad", [
    KvWritePages([bytes(16)], [0, 1], "v4"),
    KvWritePages([bytes(16)], [3], "v4"),
    KvWritePages([bytes(33)], [0], "v4"),
    KvWritePages([b""], [0], "v4"),
    KvWritePages([bytes(16)], [0], "v4", traffic_class=9),
    KvLookup([bytes(16)] * 9),
    KvReadPages([bytes(16)] * 9),
    KvLookup([bytes(16), bytes(33)]),
    KvReadPages([b""]),
], ids=["frames-count", "frame-index", "long-hash", "empty-hash", "traffic-class", "lookup-too-many",
        "read-too-many", "lookup-long-hash", "read-empty-hash"])
async def test_invalid_requests_get_a_typed_error_and_the_service_keeps_serving(tmp_path, bad):
    async with running(tmp_path, {"max_blocks_per_message": 8}) as (writer, client, address):
        with pytest.raises(RemoteError) as err:
            await client.call(address, bad, buffers=[page_for(bytes(16))])
        assert err.value.code == ErrorCode.INVALID_REQUEST
        assert len(writer.store) == 0
        msg, pages = write_message(chain(2))
        assert (await client.call(address, msg, buffers=pages)).message == KvWriteAck(2, 0)


async def test_writes_beyond_the_pending_bound_are_refused_as_overloaded(tmp_path):
    async with running(tmp_path, {"max_pending_bytes": 3 * 4096}) as (writer, client, address):
        msg, pages = write_message(chain(4))                      # 4 pages of 4 KiB
        with pytest.raises(RemoteError) as err:
            await client.call(address, msg, buffers=pages)
        assert err.value.code == ErrorCode.OVERLOADED and writer.pending_bytes == 0


async def test_a_read_reply_stops_at_the_byte_limit_and_the_rest_comes_next(tmp_path):
    keys = chain(5)
    async with running(tmp_path, {"max_read_bytes": 10_000}) as (writer, client, address):
        msg, pages = write_message(keys)
        await client.call(address, msg, buffers=pages)
        first = await client.call(address, KvReadPages(keys))
        assert first.message.found == 2                           # ~4.2 KiB records: two fit
        rest = await client.call(address, KvReadPages(keys[2:]))
        assert rest.message.found == 2
        assert same_bits(rest.frame(1), page_for(keys[3]))


async def test_file_io_runs_off_the_event_loop(tmp_path, monkeypatch):
    async with running(tmp_path) as (writer, client, address):
        slow_write = writer.store.write
        entered = threading.Event()

        def slow(*args, **kwargs):   # a disk that takes a second per write
            entered.set()
            time.sleep(1.0)
            return slow_write(*args, **kwargs)

        monkeypatch.setattr(writer.store, "write", slow)
        keys = chain(3)
        msg, pages = write_message(keys)
        pending = asyncio.create_task(client.call(address, msg, buffers=pages))
        await eventually(entered.is_set, what="write started")
        started = time.monotonic()
        assert (await client.call(address, KvLookup(keys))).message.hit_blocks == 0
        assert time.monotonic() - started < 0.8                   # answered while the write is on disk
        assert not pending.done()
        assert (await pending).message == KvWriteAck(3, 0)


async def test_gc_runs_in_the_background_and_metrics_count_everything(tmp_path):
    settings = {"gc_interval_s": 0.05, "ttl_s": {"agent": 0.3}, "segment_bytes": 8192, "capacity_bytes": 16384}
    async with running(tmp_path, settings) as (writer, client, address):
        msg, pages = write_message(chain(3, seed=1), TrafficClass.AGENT)
        await client.call(address, msg, buffers=pages)
        keys = chain(3)
        msg, pages = write_message(keys, TrafficClass.AGENT)
        await client.call(address, msg, buffers=pages)
        assert sample(writer, "epd_kv_records_written_total") == 6
        assert sample(writer, "epd_kv_segments_evicted_total") >= 1          # 16 KiB hold ~3 pages
        assert sample(writer, "epd_kv_records_evicted_total") >= 1
        await client.call(address, KvLookup(keys))
        await client.call(address, KvReadPages(keys))
        hits = sample(writer, "epd_kv_lookup_hits_total")
        assert sample(writer, "epd_kv_lookups_total") == 1 and 0 < hits <= 3
        assert sample(writer, "epd_kv_bytes_read_total") > 0 and sample(writer, "epd_kv_bytes_written_total") > 0
        # gc runs off the event loop: wait until its whole pass shows, not just the first count
        await eventually(lambda: sample(writer, "epd_kv_segments") == sample(writer, "epd_kv_records")
                         == sample(writer, "epd_kv_bytes_stored") == 0, what="gc of expired segments")
        assert sample(writer, "epd_kv_segments_expired_total") >= 1
        status = (await client.call(address, StatusQuery())).message
        assert status.kind == "kv_writer"


async def test_ttl_follows_the_traffic_class_on_the_services_clock(tmp_path):
    clock = Clock()
    agent, chatbot = chain(2, seed=1), chain(2, seed=2)
    async with running(tmp_path, clock=clock) as (writer, client, address):
        for keys, tc in ((agent, TrafficClass.AGENT), (chatbot, TrafficClass.CHATBOT)):
            msg, pages = write_message(keys, tc)
            await client.call(address, msg, buffers=pages)
        clock.advance(3 * DAY)
        assert (await client.call(address, KvLookup(agent))).message.hit_blocks == 0
        assert (await client.call(address, KvLookup(chatbot))).message.hit_blocks == 2
        assert (await client.call(address, KvReadPages(agent))).message.found == 0


async def test_a_restarted_service_serves_what_it_stored(tmp_path):
    keys = chain(4)
    async with running(tmp_path) as (writer, client, address):
        msg, pages = write_message(keys)
        await client.call(address, msg, buffers=pages)
    async with running(tmp_path) as (writer, client, address):
        assert (await client.call(address, KvLookup(keys))).message.hit_blocks == 4
        env = await client.call(address, KvReadPages(keys))
        assert all(same_bits(env.frame(i), page_for(k)) for i, k in enumerate(keys))


async def test_a_locked_store_directory_fails_the_start(tmp_path):
    root = tmp_path / "store"
    with SegmentStore(StoreSettings(root=str(root))):
        service = KvWriterService(ServiceConfig(kind="kv_writer", instance="kv", bind=f"ipc://{tmp_path}/kv.sock",
                                                settings={"root": str(root)}))
        assert await service.run(install_signals=False) == 1


def test_the_catalog_knows_the_kind_and_bad_settings_are_refused(tmp_path):
    assert resolve("kv_writer") is KvWriterService
    for settings in ({"ttl": 5}, {"fsync": "maybe"}, {"read_threads": 0}, {"gc_interval_s": 0}):
        with pytest.raises(ValueError):
            KvWriterService(ServiceConfig(kind="kv_writer", instance="kv", bind=f"ipc://{tmp_path}/kv.sock",
                                          settings=settings))
