"""File I/O backends: plain POSIX, and the USRBIO read path exercised against a stand-in for 3FS's
`hf3fs_fuse.io` (the real module ships only with a 3FS install)."""
from __future__ import annotations

import os
import sys
import types

import pytest

from kvstore import SegmentStore, StoreReader, StoreSettings
from kvstore.fileio import PosixIO, UsrbioIO, make_io
from tests.kvstore.common import Clock, chain, page_for, pages_of, same_bits


class _Result:
    def __init__(self, result: int, userdata):
        self.result, self.userdata = result, userdata


class FakeUsrbio(types.ModuleType):
    """The calls our adapter makes, done with os.preadv on the shared-memory iov."""

    def __init__(self):
        super().__init__("hf3fs_fuse.io")
        self.registered: set[int] = set()
        self.reads = 0

    def extract_mount_point(self, path: str) -> str:
        return os.path.dirname(path)

    def make_iovec(self, shm, mount_point, block_size, numa):
        class Iov:
            def __getitem__(self, index):
                return shm.buf[index]

        return Iov()

    def make_ioring(self, mount_point, entries, for_read, io_depth):
        module = self

        class Ring:
            def __init__(self):
                self.queued = []

            def prepare(self, iov, read, fd, offset, userdata=None):
                assert read and fd in module.registered
                self.queued.append((iov, fd, offset, userdata))

            def submit(self):
                return self

            def wait(self, min_results=1):
                done, self.queued = self.queued, []
                module.reads += len(done)
                return [_Result(os.preadv(fd, [iov], offset), data) for iov, fd, offset, data in done]

        return Ring()

    def register_fd(self, fd: int) -> None:
        self.registered.add(fd)

    def deregister_fd(self, fd: int) -> None:
        self.registered.remove(fd)


@pytest.fixture
def fake_hf3fs(monkeypatch):
    module = FakeUsrbio()
    package = types.ModuleType("hf3fs_fuse")
    package.io = module
    monkeypatch.setitem(sys.modules, "hf3fs_fuse", package)
    monkeypatch.setitem(sys.modules, "hf3fs_fuse.io", module)
    return module


def test_local_backend_and_3fs_without_hf3fs_fuse_use_plain_io(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "hf3fs_fuse", None)   # import fails
    assert type(make_io("local", str(tmp_path))) is PosixIO
    assert type(make_io("3fs", str(tmp_path))) is PosixIO
    with pytest.raises(ValueError):
        make_io("nfs", str(tmp_path))


def test_3fs_backend_reads_records_through_usrbio(tmp_path, fake_hf3fs):
    keys = chain(5)
    settings = StoreSettings(root=str(tmp_path), backend="3fs")
    with SegmentStore(settings, clock=Clock()) as store:
        assert store.io.name == "usrbio"
        store.write(pages_of(keys))
        assert all(same_bits(p, page_for(k)) for p, k in zip(store.read(keys), keys))
    with StoreReader(str(tmp_path), backend="3fs", clock=Clock()) as reader:
        assert all(same_bits(p, page_for(k)) for p, k in zip(reader.read(keys), keys))
    assert fake_hf3fs.reads >= 10 and fake_hf3fs.registered == set()   # every fd deregistered


def test_usrbio_reads_larger_than_the_iov_go_in_steps(tmp_path, fake_hf3fs):
    io = UsrbioIO(str(tmp_path), fake_hf3fs, iov_bytes=4096)
    path = tmp_path / "blob"
    data = os.urandom(10_000)
    path.write_bytes(data)
    fd = io.open_read(str(path))
    out = bytearray(10_000)
    assert io.pread_into(fd, 0, out) == 10_000 and bytes(out) == data
    assert io.pread_into(fd, 9_000, bytearray(2_000)) == 1_000          # short at the end of the file
    io.close(fd)
    io.close_all()
    assert fake_hf3fs.reads == 3 + 2 and fake_hf3fs.registered == set()
