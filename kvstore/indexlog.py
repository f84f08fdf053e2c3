"""The index log: how the writer tells readers in other processes what the store holds.

`<root>/index-<generation>.log` = a 32-byte header, then fixed-size 72-byte entries (PUT a record,
DROP_SEGMENT, DROP_KEY), each with its own checksum. The writer only appends, and appends a PUT only
after the record it names is written (and fsynced, per the fsync policy). A new generation starts
with a snapshot of the whole index: written to a temporary name, fsynced, renamed into place (atomic
on a local file system and on 3FS), then the older generations are deleted. The writer starts one at
every start (after rebuilding the index from the segments) and when dead entries pile up.

Readers tail the newest generation: they apply the whole entries that have arrived since their last
look and leave a partial or not-yet-valid entry at the end for the next look; on seeing a newer
generation they start over from its snapshot.
"""
from __future__ import annotations

import os
import numpy as np

from kvstore import record as fmt
from kvstore.record import Entry, FormatError

_NONE = fmt.entry_array([])

_SKIP_AFTER = 3   # looks at one bad entry with more data behind it before it is skipped as corrupt


def generations(root: str) -> list[int]:
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(g for g in map(fmt.parse_log_name, names) if g is not None)


class IndexLogWriter:
    """The writer's side. Not thread-safe: the writer's one thread owns it."""

    def __init__(self, root: str, generation: int, snapshot: np.ndarray, now: float, fsync: bool):
        """Start generation `generation` with `snapshot` (PUT entries, record.ENTRY_DTYPE)."""
        self.root, self.generation, self.fsync = root, generation, fsync
        final = os.path.join(root, fmt.log_name(generation))
        tmp = final + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            self.entries = len(snapshot)
            _write_all(fd, fmt.encode_log_header(generation, now))
            for start in range(0, len(snapshot), 1 << 16):
                _write_all(fd, fmt.encode_entries(snapshot[start:start + (1 << 16)]))
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.rename(tmp, final)
        _fsync_dir(root)
        self.fd = fd
        self.size = os.fstat(fd).st_size
        for old in generations(root):
            if old < generation:
                _unlink_quietly(os.path.join(root, fmt.log_name(old)))

    def append(self, entries: list[Entry]) -> None:
        if not entries:
            return
        data = fmt.encode_entries(fmt.entry_array(entries))
        _write_all(self.fd, data, self.size)
        self.size += len(data)
        self.entries += len(entries)
        if self.fsync:
            os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class IndexLogTail:
    """A reader's side: `poll()` returns (started over?, new entries as record.ENTRY_DTYPE records)
    since the last call."""

    def __init__(self, root: str):
        self.root = root
        self.generation: int | None = None
        self.fd = -1
        self.offset = 0
        self._bad_at = (-1, 0)     # (offset, looks) of an entry that failed its checksum

    def poll(self) -> tuple[bool, np.ndarray]:
        restarted = False
        gens = generations(self.root)
        if gens and gens[-1] != self.generation:
            newest = gens[-1]
            try:
                fd = os.open(os.path.join(self.root, fmt.log_name(newest)), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except FileNotFoundError:   # replaced between the listing and the open: next look
                return False, _NONE
            try:
                head = os.pread(fd, fmt.LOG_HEADER_SIZE, 0)
                if fmt.decode_log_header(head) != newest:
                    raise FormatError("generation mismatch")
            except (FormatError, OSError):
                os.close(fd)
                return False, _NONE
            self.close()
            self.generation, self.fd, self.offset = newest, fd, fmt.LOG_HEADER_SIZE
            self._bad_at = (-1, 0)
            restarted = True
        if self.fd < 0:
            return restarted, _NONE
        return restarted, self._read_new()

    def _read_new(self) -> np.ndarray:
        size = os.fstat(self.fd).st_size
        whole = (size - self.offset) // fmt.ENTRY_SIZE
        if whole <= 0:
            return _NONE
        data = os.pread(self.fd, whole * fmt.ENTRY_SIZE, self.offset)
        entries, ok = fmt.decode_entries(data[:len(data) // fmt.ENTRY_SIZE * fmt.ENTRY_SIZE])
        taken = len(entries)
        for bad in np.flatnonzero(~ok).tolist():
            here = self.offset + bad * fmt.ENTRY_SIZE
            looks = self._bad_at[1] + 1 if self._bad_at[0] == here else 1
            self._bad_at = (here, looks)
            if looks < _SKIP_AFTER or bad == len(entries) - 1:
                taken = bad          # maybe still being written: look again from here next time
                break
            # the same entry stayed bad while more arrived behind it: corrupt, skipped
        self.offset += taken * fmt.ENTRY_SIZE
        return entries[:taken][ok[:taken]]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _write_all(fd: int, data: bytes, offset: int | None = None) -> None:
    view = memoryview(data)
    done = 0
    while done < len(view):
        n = os.write(fd, view[done:]) if offset is None else os.pwrite(fd, view[done:], offset + done)
        done += n


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:   # some file systems (FUSE mounts among them) do not fsync directories
        pass
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
