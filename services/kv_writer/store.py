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

Space: `gc` drops whole segments whose records have all expired; before each write, the oldest
segments (lowest sequence number) are dropped while the store plus the write (with an allowance for
headers and footers) would exceed `capacity_bytes` (one write larger than the capacity overshoots).
"""
from __future__ import annotations

import collections
import contextlib
import fcntl
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import structlog

from messages.common import TrafficClass
from messages.errors import InvalidRequest
from messages.tensors import describe
from services.kv_writer import record as fmt
from services.kv_writer.fileio import make_io
from services.kv_writer.index import BlockIndex
from services.kv_writer.indexlog import IndexLogWriter, generations
from services.kv_writer.record import Entry, FormatError
from services.kv_writer.segment import (PARALLEL_MIN_BYTES, OpenSegment, plan_reads, read_records,
                                        read_seq_floor, recover_segment, scan_segment, segment_path, serve,
                                        write_seq_floor)
from services.kv_writer.settings import (StoreError, StoreLocked, StoreSettings, StoreStats,
                                         WriteResult)

LOG_COMPACT_SLACK = 100_000    # index log entries beyond twice the live ones before a new generation


class _SegmentInfo:
    __slots__ = ("seq", "size", "max_expires_at")

    def __init__(self, seq: int, size: int, max_expires_at: float):
        self.seq, self.size, self.max_expires_at = seq, size, max_expires_at


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
        self._segments: dict[int, _SegmentInfo] = {}
        self._open: dict[int, OpenSegment] = {}          # expiry slice -> segment being filled
        self._bytes = 0
        self._drops: collections.deque[tuple[bytes, int, int]] = collections.deque()   # corrupt records
        self._pool = ThreadPoolExecutor(self.settings.io_threads, thread_name_prefix="kv-io") \
            if self.settings.io_threads else None
        os.makedirs(os.path.join(self.root, "segments"), exist_ok=True)
        self._lock_fd = _lock(self.root, self.log)
        try:
            self.io = io or make_io(self.settings.backend, self.root, self.log)
            self._next_seq = 0
            self._rebuild()
            now = self.clock()
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
        return self._bytes

    @property
    def segment_count(self) -> int:
        return len(self._segments)

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
        """Pages (torch tensors as written) of the blocks. With `prefix`, the leading blocks that read
        back intact (stopping at the first miss or past `max_bytes`); else one page or None per hash."""
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
        """Store (block hash, page) pairs not already stored; a page is a contiguous CPU tensor, an
        array, a bytes-like object or a received (TensorDesc, buffer) pair. Bad input raises
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
        self._retire_idle(now)
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
                seg = self._segment_for(expires_at, len(header) + view.nbytes, now)
                entry = seg.append(key, header, view, expires_at, now)
                self._grow(seg, entry.length)
                written.append((seg, entry))
                if self.settings.fsync == "always":
                    seg.sync()
                    self._publish([entry])
        except OSError as exc:
            error = exc
            failed = self._open.get(_slice(expires_at, self.settings.slice_s))
            if failed is not None:
                self._retire(failed)
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
        self._retire_idle(now)
        expired = [info for info in self._segments.values() if info.max_expires_at <= now]
        for info in expired:
            records = self._drop_segment(info.seq, "expired")
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
            for seg in list(self._open.values()):
                self._retire(seg)
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

    def _rebuild(self) -> None:
        started = time.perf_counter()
        now = self.clock()
        segdir = os.path.join(self.root, "segments")
        seqs = sorted(s for s in map(fmt.parse_segment_name, os.listdir(segdir)) if s is not None)
        for seq in seqs:
            path = segment_path(self.root, seq)
            try:
                scan = scan_segment(self.io, path, seq)
            except FormatError as exc:   # not a segment of ours (or its header is gone): drop at next gc
                self.log.error("kv_store.segment_unreadable", segment=seq, error=str(exc))
                self._track(_SegmentInfo(seq, _size(path), float("-inf")))
                continue
            except OSError as exc:       # maybe transient: keep it, unindexed, until capacity evicts it
                self.log.error("kv_store.segment_unreadable", segment=seq, error=repr(exc))
                self._track(_SegmentInfo(seq, _size(path), float("inf")))
                continue
            if not scan.sealed:
                self.log.warning("kv_store.segment_recovered", segment=seq, records=len(scan.entries),
                                 cut_bytes=scan.size - scan.end, problem=scan.problem)
                self.stats.segments_recovered += 1
                if not len(scan.entries):
                    os.unlink(path)
                    continue
                recover_segment(self.io, path, scan)
            expires = scan.entries["expires"]
            self.index.put_entries(scan.entries[expires > now])
            self._track(_SegmentInfo(seq, scan.size, float(expires.max()) if len(expires) else float("-inf")))
        self._next_seq = max(read_seq_floor(self.root), seqs[-1] + 1 if seqs else 0)
        self.stats.rebuild_s = time.perf_counter() - started
        self.log.info("kv_store.rebuilt", records=len(self.index), segments=len(self._segments),
                      bytes=self._bytes, seconds=round(self.stats.rebuild_s, 3), io=self.io.name)

    def _track(self, info: _SegmentInfo) -> None:
        self._segments[info.seq] = info
        self._bytes += info.size

    def _grow(self, seg: OpenSegment, nbytes: int) -> None:
        info = self._segments[seg.seq]
        info.size += nbytes
        info.max_expires_at = seg.max_expires_at
        self._bytes += nbytes

    def _segment_for(self, expires_at: float, nbytes: int, now: float) -> OpenSegment:
        slice_index = _slice(expires_at, self.settings.slice_s)
        seg = self._open.get(slice_index)
        if seg is not None and seg.entries and seg.size + nbytes > self.settings.segment_bytes:
            self._retire(seg)
            seg = None
        if seg is None:
            if len(self._open) >= self.settings.max_open_segments:
                self._retire(min(self._open.values(), key=lambda s: s.last_write))
            seq = self._next_seq
            self._next_seq += 1
            write_seq_floor(self.root, self._next_seq)
            seg = OpenSegment(self.io, self.root, seq, slice_index * self.settings.slice_s, now)
            self._open[slice_index] = seg
            self._track(_SegmentInfo(seq, seg.size, float("-inf")))
        return seg

    def _retire(self, seg: OpenSegment) -> None:
        """Seal a segment and stop appending to it (on an I/O error it stays unsealed: the next
        start verifies and seals it)."""
        self._open = {k: s for k, s in self._open.items() if s is not seg}
        if seg.fd < 0:
            return
        before = seg.size
        try:
            seg.seal()
        except OSError as exc:
            self.log.error("kv_store.seal_failed", segment=seg.seq, error=repr(exc))
            seg.close()
        info = self._segments.get(seg.seq)
        if info is not None:
            info.size += seg.size - before
            self._bytes += seg.size - before

    def _retire_idle(self, now: float) -> None:
        for seg in [s for s in self._open.values() if now - s.last_write >= self.settings.slice_s]:
            self._retire(seg)

    def _make_room(self, incoming: int) -> None:
        while self._segments and self._bytes + incoming > self.settings.capacity_bytes:
            seq = min(self._segments)
            records = self._drop_segment(seq, "capacity")
            self.stats.segments_evicted += 1
            self.stats.records_evicted += records

    def _drop_segment(self, seq: int, reason: str) -> int:
        """Forget a segment (index, then index log), then delete its file; returns records forgotten."""
        info = self._segments.pop(seq)
        for slice_index, seg in list(self._open.items()):
            if seg.seq == seq:
                del self._open[slice_index]
                seg.close()
        records = self.index.drop_segment(seq)
        self._bytes -= info.size
        try:
            self._log.append([Entry(fmt.DROP_SEGMENT, seq)])
        except OSError as exc:
            self.log.error("kv_store.log_failed", error=repr(exc))
        try:
            os.unlink(segment_path(self.root, seq))
        except FileNotFoundError:
            pass
        except OSError as exc:
            self.log.error("kv_store.unlink_failed", segment=seq, error=repr(exc))
        self.log.info("kv_store.segment_dropped", segment=seq, reason=reason, records=records, bytes=info.size)
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
        checked.append((key, desc, view))
    return checked


@contextlib.contextmanager
def _bad_hashes_refused():
    """The index checks the hashes as it reads them (at C speed when all are 16 bytes)."""
    try:
        yield
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"block hashes must be bytes of 1..{fmt.MAX_KEY_BYTES}: {exc}") from None


def _slice(expires_at: float, slice_s: float) -> int:
    return math.ceil(expires_at / slice_s)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


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
