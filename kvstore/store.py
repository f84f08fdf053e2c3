"""SegmentStore: the writer's side of the KV store (block pages in segment files, see record.py).

Synchronous, with an injectable wall clock (`clock`, or `now=` per call; expiry times are stored
on disk, so they are epoch seconds). Threads: `write`, `gc` and `close` mutate and must run on one
thread at a time (the service gives them a single I/O thread); `lookup`, `locations` and `read` may
run on any thread at the same time as those (see index.py; reads open their own file descriptors).
A corrupt record found by a read is forgotten by the next `write` or `gc`.

Write path: a record is appended to the open segment of its expiry slice (records whose expiry times
fall in the same `slice_s` window share segments, so a segment expires as a whole), the touched
segments are fsynced per the fsync policy, and only then are the records published: in the memory
index and in the index log. Policies: "batch" (default: one fsync per segment per write call, then
publish), "always" (fsync and publish record by record), "none" (publish after the write returns:
survives a killed process, not a power loss; not for 3FS, whose file length is exact only after
fsync). A block already stored with at least `refresh_fraction` of its TTL left is skipped; one
closer to expiry is written again (a new copy that expires later), so hot prefixes stay.

Space (space.py keeps the segment files): `gc` drops whole segments whose records have all expired;
before each write, the oldest segments (lowest sequence number) are dropped while the store plus the
write (with an allowance for headers and footers) would exceed `capacity_bytes` (one write larger
than the capacity overshoots). A dropped segment's records are forgotten (index, then index log)
before its file is deleted.
"""
from __future__ import annotations

import collections
import contextlib
import fcntl
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import structlog

from kvstore import record as fmt
from kvstore.fileio import make_io
from kvstore.index import BlockIndex
from kvstore.indexlog import IndexLogWriter, generations
from kvstore.record import Entry
from kvstore.segment import PARALLEL_MIN_BYTES, OpenSegment, plan_reads, read_records, serve
from kvstore.settings import StoreError, StoreLocked, StoreSettings, StoreStats, WriteResult
from kvstore.space import SegmentSpace
from messages.common import TrafficClass
from messages.errors import InvalidRequest
from messages.tensors import describe

LOG_COMPACT_SLACK = 100_000    # index log entries beyond twice the live ones before a new generation


class SegmentStore:
    def __init__(self, settings: StoreSettings | None = None, clock: Callable[[], float] = time.time,
                 log=None, io=None):
        self.settings = settings or StoreSettings()
        self.clock = clock
        self.log = log or structlog.get_logger().bind(component="kv_store")
        self.root = os.path.abspath(self.settings.root)
        self.stats = StoreStats()
        self.index = BlockIndex()
        self._stats_lock = threading.Lock()
        self._drops: collections.deque[tuple[bytes, int, int]] = collections.deque()   # corrupt records
        self._pool = ThreadPoolExecutor(self.settings.io_threads, thread_name_prefix="kv-io") \
            if self.settings.io_threads else None
        os.makedirs(os.path.join(self.root, "segments"), exist_ok=True)
        self._lock_fd = _lock(self.root, self.log)
        try:
            self.io = io or make_io(self.settings.backend, self.root, self.log)
            self.space = SegmentSpace(self.io, self.root, self.settings, self.log)
            now = self.clock()
            self.space.rebuild(self.index, self.stats, now)
            self._log = IndexLogWriter(self.root, (generations(self.root) or [0])[-1] + 1, self.index.export(),
                                       now, fsync=self._log_fsync)
        except BaseException:
            if self._pool is not None:
                self._pool.shutdown()
            os.close(self._lock_fd)
            raise
        self._closed = False

    # ---- reads (any thread) ---------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.index)

    @property
    def bytes_stored(self) -> int:
        return self.space.bytes

    @property
    def segment_count(self) -> int:
        return len(self.space)

    def lookup(self, chain: Sequence[bytes], now: float | None = None) -> int:
        """How many leading blocks of the hash chain the store holds, unexpired."""
        with _bad_hashes_refused():
            hit = self.index.longest_prefix(chain, self.clock() if now is None else now)
        with self._stats_lock:
            self.stats.lookups += 1
            self.stats.lookup_blocks += len(chain)
            self.stats.lookup_hits += hit
        return hit

    def locations(self, chain: Sequence[bytes], now: float | None = None) -> list[str]:
        """"segment:offset:length" of each leading unexpired block (what a direct reader needs)."""
        now = self.clock() if now is None else now
        with _bad_hashes_refused():
            locs = self.index.prefix_locations(chain, now)
        return [fmt.format_location(loc.seq, loc.offset, loc.length) for loc in locs]

    def read(self, chain: Sequence[bytes], *, prefix: bool = True, layout: str = "", max_bytes: int | None = None,
             now: float | None = None) -> list:
        """Pages of the blocks, (TensorDesc, memoryview) pairs with the dtype and shape written. With
        `prefix`, the leading blocks that read back intact (stopping at the first miss or past
        `max_bytes`); else one page or None per hash."""
        now = self.clock() if now is None else now
        with _bad_hashes_refused():
            requests, slots = plan_reads(self.index, chain, prefix, now)
        outcomes = read_records(self.io, self.root, requests, now, layout, stop_at_miss=prefix, max_bytes=max_bytes,
                                pool=self._pool)
        served = serve(requests, slots, outcomes, len(chain), prefix, self.log)
        for req in served.corrupt:
            self._drops.append((req.key, req.seq, req.offset))
        with self._stats_lock:
            s = self.stats
            s.records_read += len(outcomes) - served.misses
            s.bytes_read += served.bytes
            s.read_misses += served.misses
            s.corrupt_records += len(served.corrupt)
        return served.pages

    # ---- writes (the one I/O thread) ------------------------------------------------------
    def write(self, pages: Sequence[tuple[bytes, object]], traffic_class: int = TrafficClass.CHATBOT,
              layout: str = "", now: float | None = None) -> WriteResult:
        """Store (block hash, page) pairs not already stored; a page is a contiguous numpy array, a
        bytes-like object or a (TensorDesc, buffer) pair (a received frame, or a worker's tensor). Bad input raises
        InvalidRequest before anything is written; an I/O failure raises StoreError."""
        self._check_open()
        self._apply_drops()
        now = self.clock() if now is None else now
        ttl = self.settings.ttl_for(traffic_class)
        if len(layout.encode()) > fmt.MAX_LAYOUT_BYTES:
            raise InvalidRequest(f"layout longer than {fmt.MAX_LAYOUT_BYTES} bytes")
        checked = _checked_pages(pages)
        todo, seen, skipped = [], set(), 0
        fresh_until = now + ttl * self.settings.refresh_fraction
        for (key, desc, view), loc in zip(checked, self.index.get_many([c[0] for c in checked])):
            if key in seen or (loc is not None and loc.expires_at >= fresh_until):
                skipped += 1
                continue
            seen.add(key)
            todo.append((key, desc, view))
        self.space.retire_idle(now)
        overhead = fmt.max_header_len() + fmt.ENTRY_SIZE   # header, footer entry; and a new segment's ends
        incoming = sum(view.nbytes + overhead for _, _, view in todo) + fmt.SEGMENT_HEADER_SIZE + fmt.TRAILER_SIZE
        self._make_room(incoming if todo else 0)
        expires_at = now + ttl
        written: list[tuple[OpenSegment, Entry]] = []
        error = None
        crcs = self._checksums_ahead(todo)
        try:
            for i, (key, desc, view) in enumerate(todo):
                header = fmt.encode_record_header(key, int(traffic_class), expires_at, now, desc.dtype,
                                                  tuple(desc.shape), layout, view,
                                                  payload_crc=crcs[i].result() if crcs else None)
                seg = self.space.segment_for(expires_at, len(header) + view.nbytes, now)
                entry = seg.append(key, header, view, expires_at, now)
                self.space.grow(seg, entry.length)
                written.append((seg, entry))
                if self.settings.fsync == "always":
                    seg.sync()
                    self._publish([entry])
        except OSError as exc:
            error = exc
            self.space.retire_slice_of(expires_at)
        if written and self.settings.fsync != "always":
            try:
                if self.settings.fsync == "batch":
                    for seg in {id(s): s for s, _ in written}.values():
                        if seg.fd >= 0:
                            seg.sync()
                self._publish([e for _, e in written])
            except OSError as exc:
                error = error or exc
                written = []
        nbytes = sum(e.length for _, e in written)
        with self._stats_lock:
            self.stats.records_written += len(written)
            self.stats.bytes_written += nbytes
            self.stats.records_skipped += skipped
            self.stats.write_errors += error is not None
        if error is not None:
            self.log.error("kv_store.write_failed", error=repr(error), written=len(written), asked=len(todo))
            raise StoreError(f"writing pages failed after {len(written)} of {len(todo)}: {error}") from error
        return WriteResult(len(written), skipped, nbytes)

    def gc(self, now: float | None = None) -> int:
        """Seal idle segments, drop segments whose records have all expired, compact the index log;
        returns how many segments went."""
        self._check_open()
        now = self.clock() if now is None else now
        self._apply_drops()
        self.space.retire_idle(now)
        expired = self.space.expired(now)
        for seq in expired:
            records = self._drop_segment(seq, "expired")
            self.stats.segments_expired += 1
            self.stats.records_expired += records
        if self._log.entries > 2 * len(self.index) + LOG_COMPACT_SLACK:
            self._log.close()
            self._log = IndexLogWriter(self.root, self._log.generation + 1, self.index.export(), now,
                                       fsync=self._log_fsync)
        return len(expired)

    def close(self) -> None:
        """Seal the open segments and release the directory (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.space.close()
            self._log.close()
        finally:
            if self._pool is not None:
                self._pool.shutdown()
            self.io.close_all()
            os.close(self._lock_fd)

    def __enter__(self) -> "SegmentStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------------------------
    @property
    def _log_fsync(self) -> bool:
        """The index log is fsynced only on 3FS, where other hosts see a file's length after fsync;
        on a local directory readers see it through the page cache, and a restart rebuilds it."""
        return self.settings.backend == "3fs" and self.settings.fsync != "none"

    def _checksums_ahead(self, todo: list) -> list | None:
        """Checksum large payloads on the pool, ahead of the writes that need them (the writes and
        checksums then overlap: both release the GIL)."""
        if self._pool is None or len(todo) < 2 or fmt.DEFAULT_CHECKSUM == fmt.CRC32C or \
                sum(view.nbytes for _, _, view in todo) < PARALLEL_MIN_BYTES * len(todo):
            return None   # (hardware crc32c runs at memory speed: a thread hop would cost more)
        return [self._pool.submit(fmt.checksum, view) for _, _, view in todo]

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("the store is closed")

    def _make_room(self, incoming: int) -> None:
        while (seq := self.space.over_capacity(incoming)) is not None:
            records = self._drop_segment(seq, "capacity")
            self.stats.segments_evicted += 1
            self.stats.records_evicted += records

    def _drop_segment(self, seq: int, reason: str) -> int:
        """Forget a segment (index, then index log), then delete its file; returns records forgotten."""
        size = self.space.remove(seq)
        records = self.index.drop_segment(seq)
        try:
            self._log.append([Entry(fmt.DROP_SEGMENT, seq)])
        except OSError as exc:
            self.log.error("kv_store.log_failed", error=repr(exc))
        self.space.delete_file(seq)
        self.log.info("kv_store.segment_dropped", segment=seq, reason=reason, records=records, bytes=size)
        return records

    def _publish(self, entries: list[Entry]) -> None:
        self._index_entries(entries)
        self._log.append(entries)

    def _index_entries(self, entries: list[Entry]) -> None:
        self.index.put_many([e.key for e in entries], [e.seq for e in entries], [e.offset for e in entries],
                            [e.length for e in entries], [e.expires_at for e in entries])

    def _apply_drops(self) -> None:
        dropped = []
        while self._drops:
            key, seq, offset = self._drops.popleft()
            if self.index.drop_key(key, seq, offset):
                dropped.append(Entry(fmt.DROP_KEY, seq, offset, 0, 0.0, key))
        if dropped:
            self._log.append(dropped)


def _checked_pages(pages: Sequence[tuple[bytes, object]]) -> list[tuple]:
    """(hash, TensorDesc, byte view) of each page, or InvalidRequest naming the first bad one."""
    checked = []
    for i, (key, page) in enumerate(pages):
        if not isinstance(key, bytes) or not 0 < len(key) <= fmt.MAX_KEY_BYTES:
            raise InvalidRequest(f"block hash {i} must be 1..{fmt.MAX_KEY_BYTES} bytes")
        try:
            desc, view = describe(page)
            fmt.dtype_code(desc.dtype)
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"page {i}: {exc}") from None
        if len(desc.shape) > fmt.MAX_NDIM:
            raise InvalidRequest(f"page {i} has more than {fmt.MAX_NDIM} dimensions")
        if any(d < 0 for d in desc.shape) or desc.nbytes() != view.nbytes:   # a pair's own descriptor
            raise InvalidRequest(f"page {i}: {view.nbytes} bytes, its descriptor {desc.dtype}{list(desc.shape)} "
                                 f"needs {desc.nbytes()}")
        checked.append((key, desc, view))
    return checked


@contextlib.contextmanager
def _bad_hashes_refused():
    """The index checks the hashes as it reads them (at C speed when all are 16 bytes)."""
    try:
        yield
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"block hashes must be bytes of 1..{fmt.MAX_KEY_BYTES}: {exc}") from None


def _lock(root: str, log) -> int:
    fd = os.open(os.path.join(root, "writer.lock"), os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StoreLocked(f"another kv writer holds {root}") from None
    except OSError as exc:   # a mount without flock (some FUSE setups): run one writer by configuration
        log.warning("kv_store.no_lock", root=root, error=repr(exc))
    return fd
