"""File I/O of the store: plain POSIX calls, or 3FS USRBIO for record reads on a 3FS mount.

Backends:
  local  a plain directory; every call is os.pread/os.pwritev/os.fsync.
  3fs    a directory on a 3FS FUSE mount, same file layout. Where `hf3fs_fuse.io` is importable (it
         ships with 3FS, not on PyPI), record reads go through USRBIO (a shared-memory iov and an
         I/O ring submitted to the FUSE daemon, bypassing FUSE's request size limits), then one
         memcpy into the caller's buffer. Everything else (writes, fsync, headers, footers, the
         index log) goes through the FUSE mount with plain calls: 3FS publishes a file's exact
         length on fsync/close, so the writer's fsync-per-batch policy is what makes new records
         visible to readers on other hosts. Without `hf3fs_fuse` the 3fs backend is plain I/O.
Read errors (a segment deleted under a reader, EIO) surface as OSError; callers count them as misses.
"""
from __future__ import annotations

import os
import threading
from typing import Sequence

BACKENDS = ("local", "3fs")


class PosixIO:
    name = "posix"

    def open_read(self, path: str) -> int:
        return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))

    def open_write(self, path: str, create: bool = False) -> int:
        flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0) | ((os.O_CREAT | os.O_EXCL) if create else 0)
        return os.open(path, flags, 0o644)

    def close(self, fd: int) -> None:
        os.close(fd)

    def pread_into(self, fd: int, offset: int, buf) -> int:
        """Fill `buf` (a writable buffer) from `offset`; returns the bytes read (short at end of file)."""
        view = memoryview(buf).cast("B")
        done = 0
        while done < view.nbytes:
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                break
            done += n
        return done

    def pwrite(self, fd: int, offset: int, buffers: Sequence) -> int:
        """Write every buffer back to back from `offset` (retrying short writes); returns the bytes."""
        views = [memoryview(b).cast("B") for b in buffers]
        total = sum(v.nbytes for v in views)
        done = 0
        while done < total:
            n = os.pwritev(fd, _skip(views, done), offset + done)
            if n <= 0:
                raise OSError(f"pwritev wrote {n} bytes")
            done += n
        return total

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def close_all(self) -> None:
        """Release what the backend holds (nothing for plain I/O)."""


def _skip(views: list[memoryview], count: int) -> list[memoryview]:
    out = []
    for v in views:
        if count >= v.nbytes:
            count -= v.nbytes
            continue
        out.append(v[count:])
        count = 0
    return out


class UsrbioIO(PosixIO):
    """Record reads through 3FS USRBIO (`hf3fs_fuse.io`): a staging iov of `iov_bytes` in shared
    memory and one read ring, used under a lock (one read in flight per store object; reads larger
    than the iov go in iov-sized steps)."""

    name = "usrbio"

    def __init__(self, mount_point: str, io_module, iov_bytes: int = 64 << 20):
        from multiprocessing.shared_memory import SharedMemory
        self._io = io_module
        self._lock = threading.Lock()
        self._shm = SharedMemory(size=iov_bytes, create=True)
        self._iov = io_module.make_iovec(self._shm, mount_point, 0, -1)   # shm, mount, block size, numa
        self._shm.unlink()   # the iov keeps its own link; the name is not needed after this
        self._ring = io_module.make_ioring(mount_point, 16, True, 0)       # entries, for_read, io_depth
        self._iov_bytes = iov_bytes
        self._registered: set[int] = set()

    def open_read(self, path: str) -> int:
        fd = super().open_read(path)
        try:
            self._io.register_fd(fd)
        except Exception:
            os.close(fd)
            raise
        self._registered.add(fd)
        return fd

    def close(self, fd: int) -> None:
        if fd in self._registered:
            self._registered.discard(fd)
            try:
                self._io.deregister_fd(fd)
            finally:
                os.close(fd)
            return
        os.close(fd)

    def pread_into(self, fd: int, offset: int, buf) -> int:
        if fd not in self._registered:   # a descriptor opened for writing: plain I/O
            return super().pread_into(fd, offset, buf)
        out = memoryview(buf).cast("B")
        done = 0
        with self._lock:
            while done < out.nbytes:
                step = min(out.nbytes - done, self._iov_bytes)
                target = self._iov[:step]
                self._ring.prepare(target, True, fd, offset + done, userdata=target)
                (result,) = self._ring.submit().wait(min_results=1)
                if result.result < 0:
                    raise OSError(-result.result, os.strerror(-result.result))
                if result.result == 0:
                    break
                out[done:done + result.result] = self._shm.buf[:result.result]
                done += result.result
        return done

    def close_all(self) -> None:
        with self._lock:
            self._ring = self._iov = None
            self._shm.close()


def make_io(backend: str, root: str, log=None):
    """The file I/O for a backend (see the module docstring)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "local":
        return PosixIO()
    try:
        import hf3fs_fuse.io as io_module
    except ImportError:
        if log is not None:
            log.info("kv_store.usrbio_unavailable", detail="hf3fs_fuse not importable: plain file I/O on the mount")
        return PosixIO()
    mount = io_module.extract_mount_point(os.path.abspath(root))
    return UsrbioIO(mount, io_module)
