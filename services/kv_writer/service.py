"""KvWriterService: the asyncio shell around kvstore.SegmentStore.

Decode workers send KvWritePages (block hashes + one buffer frame per page): a one-way notification,
answered only when it fails (ErrorReply) or when the sender asks for an acknowledgement (`ack=True`
-> KvWriteAck(written, skipped)); a worker persisting blocks does not wait on the store. Tools
send KvLookup, answered with KvLookupReply(hit_blocks, locations) (the prefill router reads the index
itself with kvstore.StoreReader). Workers that want pages through
the service send KvReadPages, answered with KvPages(found, page_frames) and the pages as buffer
frames (prefill workers normally read the files directly with kvstore.StoreReader).

File I/O never runs on the event loop: writes, gc and the store's start and close run on one writer
thread (in arrival order), reads on a small pool; lookups are in-memory index reads (tens to a
couple of hundred microseconds) and run inline. Writes waiting for the writer thread are bounded by
`max_pending_bytes` (beyond it a write is refused as OVERLOADED); a read reply carries at most
`max_read_bytes` of pages (`found` says how many; ask again for the rest).

Settings (ServiceConfig.settings): the StoreSettings fields (root, backend, segment_bytes,
capacity_bytes, ttl_s {"agent": s, "chatbot": s}, slice_s, fsync, refresh_fraction,
max_open_segments, io_threads) and gc_interval_s, read_threads, max_blocks_per_message, max_pending_bytes,
max_read_bytes.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from kvstore.settings import StoreSettings
from kvstore.store import SegmentStore
from messages.errors import InvalidRequest, Overloaded
from messages.kv_store import KvLookup, KvLookupReply, KvPages, KvReadPages, KvWriteAck, KvWritePages
from services.kv_writer.metrics import declare_metrics
from services.runtime.config import ServiceConfig
from services.runtime.context import Context
from services.runtime.service import Handler, Service
from services.runtime.settings import flat_field, parse_settings, require_positive


@dataclass(slots=True, frozen=True)
class KvWriterSettings:
    store: StoreSettings = flat_field(StoreSettings)   # the store's own keys, given at the top level
    gc_interval_s: float = 60.0
    read_threads: int = 4
    max_blocks_per_message: int = 4096
    max_pending_bytes: int = 4 << 30
    max_read_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        require_positive(self, "gc_interval_s")
        if min(self.read_threads, self.max_blocks_per_message, self.max_pending_bytes, self.max_read_bytes) < 1:
            raise ValueError("read_threads, max_blocks_per_message, max_pending_bytes, max_read_bytes must be >= 1")


class KvWriterService(Service):
    kind = "kv_writer"

    def __init__(self, config: ServiceConfig, clock: Callable[[], float] = time.time):
        self.settings = parse_settings(KvWriterSettings, config.settings, self.kind)
        self.clock = clock   # wall clock for expiry (tests pass their own)
        self.store: SegmentStore | None = None
        self.pending_bytes = 0
        self._writer: ThreadPoolExecutor | None = None
        self._readers: ThreadPoolExecutor | None = None
        self._gc: asyncio.Task | None = None
        super().__init__(config)
        declare_metrics(self.metrics, self)

    def handlers(self) -> dict[type, Handler]:
        return {KvWritePages: self.on_write, KvLookup: self.on_lookup, KvReadPages: self.on_read}

    # ---- handlers ----------------------------------------------------------------------
    async def on_write(self, msg: KvWritePages, ctx: Context) -> KvWriteAck | None:
        self._check_count(msg.block_hashes)
        if len(msg.page_frames) != len(msg.block_hashes):
            raise InvalidRequest(f"{len(msg.block_hashes)} block hashes but {len(msg.page_frames)} page frames")
        env = ctx.envelope
        pages, nbytes = [], 0
        for h, frame in zip(msg.block_hashes, msg.page_frames):
            if not 0 <= frame < len(env.buffers):
                raise InvalidRequest(f"page frame {frame} does not exist ({len(env.buffers)} buffers travelled)")
            page = env.frame(frame)
            pages.append((h, page))
            nbytes += page[0].nbytes()
        if self.pending_bytes + nbytes > self.settings.max_pending_bytes:
            raise Overloaded(f"{self.pending_bytes + nbytes} bytes of writes would be pending "
                             f"(limit {self.settings.max_pending_bytes})")
        self.pending_bytes += nbytes
        try:
            result = await asyncio.get_running_loop().run_in_executor(
                self._writer, self.store.write, pages, msg.traffic_class, msg.layout)
        finally:
            self.pending_bytes -= nbytes
        return KvWriteAck(result.written, result.skipped) if msg.ack else None

    async def on_lookup(self, msg: KvLookup, ctx: Context) -> KvLookupReply:
        self._check_count(msg.block_hashes)
        now = self.store.clock()
        hit = self.store.lookup(msg.block_hashes, now)
        if not msg.with_locations:
            return KvLookupReply(hit)
        locations = self.store.locations(msg.block_hashes[:hit], now)
        return KvLookupReply(len(locations), locations)   # a segment dropped in between shortens both

    async def on_read(self, msg: KvReadPages, ctx: Context) -> None:
        self._check_count(msg.block_hashes)
        store = self.store
        pages = await asyncio.get_running_loop().run_in_executor(
            self._readers, lambda: store.read(msg.block_hashes, layout=msg.layout,
                                              max_bytes=self.settings.max_read_bytes))
        ctx.reply(KvPages(len(pages), list(range(len(pages)))), buffers=pages)

    def _check_count(self, hashes: list[bytes]) -> None:
        if len(hashes) > self.settings.max_blocks_per_message:
            raise InvalidRequest(f"{len(hashes)} blocks in one message; at most {self.settings.max_blocks_per_message}")

    # ---- lifecycle ---------------------------------------------------------------------
    async def on_start(self) -> None:
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-write")
        self._readers = ThreadPoolExecutor(self.settings.read_threads, thread_name_prefix="kv-read")
        loop = asyncio.get_running_loop()
        try:
            self.store = await loop.run_in_executor(self._writer, lambda: SegmentStore(
                self.settings.store, clock=self.clock, log=self.log.bind(component="kv_store")))
        except BaseException:
            self._shutdown_pools()
            raise
        self._gc = loop.create_task(self._collect_garbage())
        s = self.settings.store
        self.log.info("kv_writer.started", root=self.store.root, backend=s.backend, io=self.store.io.name,
                      records=len(self.store), segments=self.store.segment_count, bytes=self.store.bytes_stored,
                      capacity_bytes=s.capacity_bytes, segment_bytes=s.segment_bytes, fsync=s.fsync, ttl_s=s.ttl_s)

    async def on_stop(self) -> None:
        if self._gc is not None:
            self._gc.cancel()
            await asyncio.gather(self._gc, return_exceptions=True)
            self._gc = None
        try:
            if self.store is not None:
                await asyncio.get_running_loop().run_in_executor(self._writer, self.store.close)
        finally:
            self._shutdown_pools()

    def _shutdown_pools(self) -> None:
        for pool in (self._writer, self._readers):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    async def _collect_garbage(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.settings.gc_interval_s)
            try:
                dropped = await loop.run_in_executor(self._writer, self.store.gc)
                if dropped:
                    self.log.info("kv_writer.gc", segments_dropped=dropped, segments=self.store.segment_count)
            except Exception:   # a failing gc must not end gc for good: log it, try next tick
                self.log.exception("kv_writer.gc_failed")
