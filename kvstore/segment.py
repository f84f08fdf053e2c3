"""Segment files: appending and sealing (writer), scanning at restart, and reading records back.

See `record.py` for the bytes. A segment is written by one thread of one process; any number of
readers, in any process, read records out of it by (offset, length), each read verifying both
checksums, the key and the expiry. Anything wrong is a miss with a reason, never a served page.
A page read back is a (TensorDesc, memoryview) pair over a buffer of its own (dtype and shape as
written); it converts to a numpy array or (in a worker) an engine tensor without copying.
"""
from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from kvstore import record as fmt
from kvstore.record import Entry, FormatError
from messages.tensors import TensorDesc


def segment_path(root: str, seq: int) -> str:
    return os.path.join(root, "segments", fmt.segment_name(seq))


_SEQ = struct.Struct("<QI")


def read_seq_floor(root: str) -> int:
    """The next segment number ever handed out (kept so numbers are not reused after segments go)."""
    try:
        with open(os.path.join(root, "segments", "next-seq"), "rb") as f:
            seq, crc = _SEQ.unpack(f.read(_SEQ.size))
    except (OSError, struct.error):
        return 0
    return seq if zlib.crc32(struct.pack("<Q", seq)) == crc else 0


def write_seq_floor(root: str, seq: int) -> None:
    fd = os.open(os.path.join(root, "segments", "next-seq"), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, _SEQ.pack(seq, zlib.crc32(struct.pack("<Q", seq))), 0)
    finally:
        os.close(fd)


class OpenSegment:
    """The segment the writer appends to. Not thread-safe: the writer's one thread owns it."""

    def __init__(self, io, root: str, seq: int, slice_end: float, now: float):
        self.io, self.seq, self.slice_end = io, seq, slice_end
        self.path = segment_path(root, seq)
        self.fd = io.open_write(self.path, create=True)
        self.entries: list[Entry] = []
        self.max_expires_at = float("-inf")
        self.last_write = now
        self.unsynced = False
        try:
            io.pwrite(self.fd, 0, [fmt.encode_segment_header(seq, slice_end, now)])
        except OSError:
            io.close(self.fd)
            raise
        self.size = fmt.SEGMENT_HEADER_SIZE

    def append(self, key: bytes, header: bytes, payload, expires_at: float, now: float) -> Entry:
        """Write one record at the end; on failure cut the file back to where it was and re-raise."""
        offset = self.size
        try:
            length = self.io.pwrite(self.fd, offset, [header, payload])
        except OSError:
            try:
                os.ftruncate(self.fd, offset)
            except OSError:
                pass
            raise
        self.size = offset + length
        self.unsynced = True
        self.last_write = now
        self.max_expires_at = max(self.max_expires_at, expires_at)
        entry = Entry(fmt.PUT, self.seq, offset, length, expires_at, key)
        self.entries.append(entry)
        return entry

    def sync(self) -> None:
        if self.unsynced:
            self.io.fsync(self.fd)
            self.unsynced = False

    def seal(self) -> None:
        """Append the footer (one entry per record) and the trailer, fsync, close."""
        try:
            footer = fmt.encode_entries(fmt.entry_array(self.entries))
            trailer = fmt.encode_trailer(self.size, len(self.entries), zlib.crc32(footer))
            self.size += self.io.pwrite(self.fd, self.size, [footer, trailer])
            self.io.fsync(self.fd)
            self.unsynced = False
        finally:
            self.close()

    def close(self) -> None:
        if self.fd >= 0:
            self.io.close(self.fd)
            self.fd = -1


@dataclass(slots=True)
class ScanResult:
    seq: int
    size: int                        # file size as found
    end: int                         # end of the last good record (where a footer goes)
    sealed: bool
    entries: np.ndarray              # record.ENTRY_DTYPE, one PUT per record
    problem: str = ""                # why a scan stopped early ("" = clean)


def scan_segment(io, path: str, seq: int) -> ScanResult:
    """What a segment holds: a sealed one from its footer; an unsealed one record by record, every
    payload verified, stopping at the first torn or corrupt record. Raises FormatError when the
    file is not a segment of ours, OSError when it cannot be read."""
    fd = io.open_read(path)
    try:
        size = os.fstat(fd).st_size
        head = _read(io, fd, 0, fmt.SEGMENT_HEADER_SIZE)
        found_seq, _, _ = fmt.decode_segment_header(head)
        if found_seq != seq:
            raise FormatError(f"segment header says {found_seq}, file name says {seq}")
        sealed = _read_footer(io, fd, seq, size)
        if sealed is not None:
            return ScanResult(seq, size, sealed[0], True, sealed[1])
        return _scan_records(io, fd, seq, size)
    finally:
        io.close(fd)


def _read(io, fd: int, offset: int, length: int) -> bytearray:
    buf = bytearray(length)
    got = io.pread_into(fd, offset, buf)
    return buf[:got] if got < length else buf


def _read_footer(io, fd: int, seq: int, size: int) -> tuple[int, np.ndarray] | None:
    if size < fmt.SEGMENT_HEADER_SIZE + fmt.TRAILER_SIZE:
        return None
    try:
        offset, count, footer_crc = fmt.decode_trailer(bytes(_read(io, fd, size - fmt.TRAILER_SIZE, fmt.TRAILER_SIZE)))
    except FormatError:
        return None
    if offset + count * fmt.ENTRY_SIZE + fmt.TRAILER_SIZE != size or offset < fmt.SEGMENT_HEADER_SIZE:
        return None
    footer = _read(io, fd, offset, count * fmt.ENTRY_SIZE)
    if len(footer) != count * fmt.ENTRY_SIZE or zlib.crc32(footer) != footer_crc:
        return None
    entries, ok = fmt.decode_entries(bytes(footer), verify=False)   # the footer's checksum covers them
    if not ok.all() or (entries["kind"] != fmt.PUT).any() or (entries["seq"] != seq).any() \
            or (entries["offset"] + entries["length"] > offset).any() or (entries["key_len"] < 1).any():
        return None
    return offset, entries


def _scan_records(io, fd: int, seq: int, size: int) -> ScanResult:
    result = ScanResult(seq, size, fmt.SEGMENT_HEADER_SIZE, False, fmt.entry_array([]))
    found: list[Entry] = []
    offset = fmt.SEGMENT_HEADER_SIZE
    buf = bytearray(fmt.max_header_len())
    while offset < size:
        try:
            head = memoryview(buf)[:io.pread_into(fd, offset, buf)]
            header = fmt.decode_record_header(head)
            if offset + header.length > size:
                raise FormatError(f"record of {header.length} bytes runs past the end of the file")
            whole = bytearray(header.length)
            if io.pread_into(fd, offset, whole) != header.length:
                raise FormatError("short read")
            if fmt.checksum(memoryview(whole)[header.header_len:], header.checksum_kind) != header.payload_crc:
                raise FormatError("payload checksum mismatch")
        except FormatError as exc:
            result.problem = f"at offset {offset}: {exc}"
            break
        found.append(Entry(fmt.PUT, seq, offset, header.length, header.expires_at, header.key))
        offset += header.length
        result.end = offset
    result.entries = fmt.entry_array(found)
    return result


def recover_segment(io, path: str, scan: ScanResult) -> None:
    """Writer only: cut an unsealed segment after its last good record and seal it."""
    fd = io.open_write(path)
    try:
        if scan.size != scan.end:
            os.ftruncate(fd, scan.end)
        footer = fmt.encode_entries(scan.entries)
        io.pwrite(fd, scan.end, [footer, fmt.encode_trailer(scan.end, len(scan.entries), zlib.crc32(footer))])
        io.fsync(fd)
    finally:
        io.close(fd)
    scan.size = scan.end + len(scan.entries) * fmt.ENTRY_SIZE + fmt.TRAILER_SIZE
    scan.sealed = True


# ---- reading records back ---------------------------------------------------------------------
@dataclass(slots=True)
class ReadRequest:
    seq: int
    offset: int
    length: int
    key: bytes | None = None         # when known, the record must carry it


@dataclass(slots=True)
class ReadOutcome:
    page: tuple[TensorDesc, memoryview] | None   # the record's payload, in its own buffer
    miss: str = ""                   # "" = served; else why not ("corrupt: ...", "expired", "error: ...")
    corrupt: bool = False            # checksum / format failure (the caller forgets the record)


PARALLEL_MIN_BYTES = 64 << 10   # records smaller than this are read inline (a thread hop costs more)


def read_records(io, root: str, requests: Sequence[ReadRequest], now: float, layout: str = "",
                 stop_at_miss: bool = False, max_bytes: int | None = None, pool=None) -> list[ReadOutcome]:
    """Read and verify records, opening each segment once. With `stop_at_miss` (a chain prefix) the
    outcomes end at the first miss. Only the leading requests within `max_bytes` are read (at least
    one). With a thread pool and the slow zlib crc32, large records are read and verified in parallel
    (both release the GIL); hardware crc32c keeps up with memory, so those go inline."""
    if max_bytes is not None:
        total, count = 0, 0
        for req in requests:
            total += req.length
            if total > max_bytes and count:
                break
            count += 1
        requests = requests[:count]
    fds: dict[int, int | OSError] = {}
    try:
        for req in requests:
            if req.seq not in fds:
                try:
                    fds[req.seq] = io.open_read(segment_path(root, req.seq))
                except OSError as exc:
                    fds[req.seq] = exc

        def one(req: ReadRequest) -> ReadOutcome:
            fd = fds[req.seq]
            if isinstance(fd, OSError):
                return ReadOutcome(None, f"error: {fd}")
            return read_record(io, fd, req, now, layout)

        parallel = pool is not None and len(requests) > 1 and fmt.DEFAULT_CHECKSUM != fmt.CRC32C and \
            sum(r.length for r in requests) >= PARALLEL_MIN_BYTES * len(requests)   # (crc32c: inline is faster)
        pending = [pool.submit(one, req) for req in requests] if parallel else None
        outcomes: list[ReadOutcome] = []
        try:
            for i, req in enumerate(requests):
                outcome = pending[i].result() if parallel else one(req)
                outcomes.append(outcome)
                if outcome.page is None and stop_at_miss:
                    break
        finally:
            if parallel:   # reads past a miss are not needed; those already running finish first
                for future in pending:
                    future.cancel()
                for future in pending:
                    if not future.cancelled():
                        future.exception()
    finally:
        for fd in fds.values():
            if not isinstance(fd, OSError):
                io.close(fd)
    return outcomes


def read_record(io, fd: int, req: ReadRequest, now: float, layout: str = "") -> ReadOutcome:
    if not fmt.MIN_RECORD_BYTES <= req.length <= fmt.MAX_RECORD_BYTES:
        return ReadOutcome(None, "corrupt: implausible record length", corrupt=True)
    raw = np.empty(req.length, np.uint8)   # one fresh buffer per record: the page served is a view of it
    try:
        got = io.pread_into(fd, req.offset, raw)
    except OSError as exc:
        return ReadOutcome(None, f"error: {exc}")
    if got != req.length:
        return ReadOutcome(None, f"corrupt: short read ({got} of {req.length} bytes)", corrupt=True)
    view = memoryview(raw)
    try:
        header = fmt.decode_record_header(view)
    except FormatError as exc:
        return ReadOutcome(None, f"corrupt: {exc}", corrupt=True)
    if header.length != req.length or (req.key is not None and header.key != req.key):
        return ReadOutcome(None, "stale: another record is there")   # intact, but not the one asked for
    try:
        if fmt.checksum(view[header.header_len:], header.checksum_kind) != header.payload_crc:
            raise FormatError("payload checksum mismatch")
        desc = TensorDesc(header.dtype, header.shape)
        if any(d < 0 for d in header.shape) or desc.nbytes() != header.payload_len:
            raise FormatError("shape does not match the payload")
    except FormatError as exc:
        return ReadOutcome(None, f"corrupt: {exc}", corrupt=True)
    if header.expires_at <= now:
        return ReadOutcome(None, "expired")
    if layout and header.layout != layout:
        return ReadOutcome(None, f"layout {header.layout!r}, not {layout!r}")
    return ReadOutcome((desc, view[header.header_len:]))


def plan_reads(index, chain: Sequence[bytes], prefix: bool, now: float) -> tuple[list[ReadRequest], list[int]]:
    """The records to read for a chain (its leading present blocks, or every present one) and the
    position in the chain of each."""
    if prefix:
        locs = index.prefix_locations(chain, now)
        return [ReadRequest(loc.seq, loc.offset, loc.length, chain[i]) for i, loc in enumerate(locs)], \
            list(range(len(locs)))
    requests, slots = [], []
    for i, (key, loc) in enumerate(zip(chain, index.get_many(chain))):
        if loc is not None and loc.expires_at > now:
            requests.append(ReadRequest(loc.seq, loc.offset, loc.length, key))
            slots.append(i)
    return requests, slots


@dataclass(slots=True)
class Served:
    pages: list                      # prefix: the leading pages; else one page or None per position
    bytes: int = 0
    misses: int = 0
    corrupt: list[ReadRequest] = field(default_factory=list)


def serve(requests: Sequence[ReadRequest], slots: Sequence[int], outcomes: Sequence[ReadOutcome], count: int,
          prefix: bool, log) -> Served:
    """Pages out of read outcomes; every miss is logged with its reason."""
    served = Served([] if prefix else [None] * count)
    for slot, req, outcome in zip(slots, requests, outcomes):
        if outcome.page is None:
            served.misses += 1
            if outcome.corrupt:
                served.corrupt.append(req)
            log.warning("kv_store.read_miss", segment=req.seq, offset=req.offset, reason=outcome.miss)
            if prefix:
                break
            continue
        served.bytes += req.length
        if prefix:
            served.pages.append(outcome.page)
        else:
            served.pages[slot] = outcome.page
    return served
