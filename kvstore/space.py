"""SegmentSpace: the writer's segment files, their sizes and expiries, from rebuild to deletion.

Records whose expiry times fall in the same `slice_s` window share segments (one open segment per
slice), so a segment expires as a whole: gc drops segments whose every record has expired, and
capacity eviction drops the oldest segments (lowest sequence number) first. This module decides
which segments go and keeps the byte count; forgetting their records (index, index log) is the
store's part, done before the file is deleted (`SegmentStore._drop_segment`).

Not thread-safe: the writer's one thread owns it (store.py).
"""
from __future__ import annotations

import math
import os
import time

from kvstore import record as fmt
from kvstore.index import BlockIndex
from kvstore.record import FormatError
from kvstore.segment import OpenSegment, read_seq_floor, recover_segment, scan_segment, segment_path, write_seq_floor
from kvstore.settings import StoreSettings, StoreStats


class SegmentInfo:
    __slots__ = ("seq", "size", "max_expires_at")

    def __init__(self, seq: int, size: int, max_expires_at: float):
        self.seq, self.size, self.max_expires_at = seq, size, max_expires_at


class SegmentSpace:
    def __init__(self, io, root: str, settings: StoreSettings, log):
        self.io, self.root, self.settings, self.log = io, root, settings, log
        self.segments: dict[int, SegmentInfo] = {}
        self.open: dict[int, OpenSegment] = {}          # expiry slice -> segment being filled
        self.bytes = 0
        self.next_seq = 0

    def __len__(self) -> int:
        return len(self.segments)

    # ---- start ---------------------------------------------------------------------------------
    def rebuild(self, index: BlockIndex, stats: StoreStats, now: float) -> None:
        """Index the records of every segment on disk (a sealed one from its footer; an unsealed
        one, left by a writer that died, verified record by record, cut and sealed; one it died
        creating, shorter than a segment header, deleted)."""
        started = time.perf_counter()
        segdir = os.path.join(self.root, "segments")
        seqs = sorted(s for s in map(fmt.parse_segment_name, os.listdir(segdir)) if s is not None)
        for seq in seqs:
            path = segment_path(self.root, seq)
            try:
                scan = scan_segment(self.io, path, seq)
            except FormatError as exc:
                if _size(path) < fmt.SEGMENT_HEADER_SIZE:   # the writer died making it: it never held a record
                    self.log.warning("kv_store.segment_recovered", segment=seq, records=0, problem=str(exc))
                    stats.segments_recovered += 1
                    os.unlink(path)
                    continue
                # not a segment of ours (or its header is gone): dropped at the next gc
                self.log.error("kv_store.segment_unreadable", segment=seq, error=str(exc))
                self.track(SegmentInfo(seq, _size(path), float("-inf")))
                continue
            except OSError as exc:       # maybe transient: keep it, unindexed, until capacity evicts it
                self.log.error("kv_store.segment_unreadable", segment=seq, error=repr(exc))
                self.track(SegmentInfo(seq, _size(path), float("inf")))
                continue
            if not scan.sealed:
                self.log.warning("kv_store.segment_recovered", segment=seq, records=len(scan.entries),
                                 cut_bytes=scan.size - scan.end, problem=scan.problem)
                stats.segments_recovered += 1
                if not len(scan.entries):
                    os.unlink(path)
                    continue
                recover_segment(self.io, path, scan)
            expires = scan.entries["expires"]
            index.put_entries(scan.entries[expires > now])
            self.track(SegmentInfo(seq, scan.size, float(expires.max()) if len(expires) else float("-inf")))
        self.next_seq = max(read_seq_floor(self.root), seqs[-1] + 1 if seqs else 0)
        stats.rebuild_s = time.perf_counter() - started
        self.log.info("kv_store.rebuilt", records=len(index), segments=len(self.segments),
                      bytes=self.bytes, seconds=round(stats.rebuild_s, 3), io=self.io.name)

    # ---- appending -----------------------------------------------------------------------------
    def segment_for(self, expires_at: float, nbytes: int, now: float) -> OpenSegment:
        """The open segment of the expiry's slice with room for `nbytes` (a new one if need be)."""
        slice_index = slice_of(expires_at, self.settings.slice_s)
        seg = self.open.get(slice_index)
        if seg is not None and seg.entries and seg.size + nbytes > self.settings.segment_bytes:
            self.retire(seg)
            seg = None
        if seg is None:
            if len(self.open) >= self.settings.max_open_segments:
                self.retire(min(self.open.values(), key=lambda s: s.last_write))
            seq = self.next_seq
            self.next_seq += 1
            write_seq_floor(self.root, self.next_seq)
            seg = OpenSegment(self.io, self.root, seq, slice_index * self.settings.slice_s, now)
            self.open[slice_index] = seg
            self.track(SegmentInfo(seq, seg.size, float("-inf")))
        return seg

    def grow(self, seg: OpenSegment, nbytes: int) -> None:
        info = self.segments[seg.seq]
        info.size += nbytes
        info.max_expires_at = seg.max_expires_at
        self.bytes += nbytes

    def retire(self, seg: OpenSegment) -> None:
        """Seal a segment and stop appending to it (on an I/O error it stays unsealed: the next
        start verifies and seals it)."""
        self.open = {k: s for k, s in self.open.items() if s is not seg}
        if seg.fd < 0:
            return
        before = seg.size
        try:
            seg.seal()
        except OSError as exc:
            self.log.error("kv_store.seal_failed", segment=seg.seq, error=repr(exc))
            seg.close()
        info = self.segments.get(seg.seq)
        if info is not None:
            info.size += seg.size - before
            self.bytes += seg.size - before

    def retire_idle(self, now: float) -> None:
        for seg in [s for s in self.open.values() if now - s.last_write >= self.settings.slice_s]:
            self.retire(seg)

    def retire_slice_of(self, expires_at: float) -> None:
        """Stop appending to the segment of this expiry (a write to it failed)."""
        seg = self.open.get(slice_of(expires_at, self.settings.slice_s))
        if seg is not None:
            self.retire(seg)

    def close(self) -> None:
        for seg in list(self.open.values()):
            self.retire(seg)

    # ---- which segments go ----------------------------------------------------------------------
    def expired(self, now: float) -> list[int]:
        """Segments whose every record has expired."""
        return [info.seq for info in self.segments.values() if info.max_expires_at <= now]

    def over_capacity(self, incoming: int) -> int | None:
        """The oldest segment, while the store plus `incoming` bytes would exceed the capacity."""
        if self.segments and self.bytes + incoming > self.settings.capacity_bytes:
            return min(self.segments)
        return None

    def remove(self, seq: int) -> int:
        """Stop tracking a segment (closing it if open); returns its size. The file stays until
        `delete_file`, so its records can be forgotten first."""
        info = self.segments.pop(seq)
        for slice_index, seg in list(self.open.items()):
            if seg.seq == seq:
                del self.open[slice_index]
                seg.close()
        self.bytes -= info.size
        return info.size

    def delete_file(self, seq: int) -> None:
        try:
            os.unlink(segment_path(self.root, seq))
        except FileNotFoundError:
            pass
        except OSError as exc:
            self.log.error("kv_store.unlink_failed", segment=seq, error=repr(exc))

    def track(self, info: SegmentInfo) -> None:
        self.segments[info.seq] = info
        self.bytes += info.size


def slice_of(expires_at: float, slice_s: float) -> int:
    return math.ceil(expires_at / slice_s)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
