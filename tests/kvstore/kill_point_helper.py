"""Test-only: a KV writer process that SIGKILLs itself at one exact point of the store's write path.

The store's code is not changed: this process wraps its functions (file writes, publish, index log,
recovery) before opening it, and at the chosen point leaves the files as a crash there would (a
record cut in half, a footer without its trailer, ...) and sends itself SIGKILL.

  python -m tests.kvstore.kill_point_helper write ROOT FIRST FSYNC [POINT:N or ""] [COUNT]
      writes chain FIRST, FIRST+1, ... printing "started <stats>" once the store is open and
      "wrote <n>" after each write returns (= published); with a kill point it dies the N-th time
      the point is reached (exit 3 if it never is); without one it writes COUNT chains and exits 0.
  python -m tests.kvstore.kill_point_helper serve
      the kv_writer service (`services.runtime.main`, EPD_* config), armed from EPD_TEST_KILL_AT.

Before dying it prints "killing at <point>" (so a test knows the point was reached, not just that
the process died). The tests' side is here too: a reader that checks every page it is served while
writers die and restart, and what a crash leaves on disk.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from dataclasses import dataclass, field

import kvstore.indexlog
import kvstore.space
from kvstore import SegmentStore, StoreReader, StoreSettings
from kvstore import record as fmt
from kvstore.fileio import PosixIO
from kvstore.indexlog import IndexLogTail, IndexLogWriter
from kvstore.segment import ScanResult, scan_segment, segment_path
from messages.tensors import TensorDesc
from tests.kvstore.common import chain, page_for, same_bits

CHAIN_BLOCKS = 4
PAGE_TILES = 16                # a page = a 4 KiB tile (from its hash) repeated: 64 KiB
SEGMENT_BYTES = 1 << 20        # 15 records a segment: the 16th record seals segment 0
RUNAWAY_CHAINS = 40            # a kill point not reached by then is a broken test

# point -> the event it fires on (what the store is doing when the process dies there)
POINTS = {
    "torn-record-header": "record",      # half a record header written
    "torn-record-payload": "record",     # the header and half the payload written
    "before-publish": "publish",         # records written (and fsynced, per policy), not published
    "after-publish": "published",        # published; nothing fsynced since (fsync "none")
    "torn-log-entry": "log-append",      # a publish cut inside its last index log entry
    "torn-seal": "seal",                 # a sealing segment's footer written, its trailer not
    "sealed-unsynced": "seal",           # footer and trailer written, the fsync not done
    "empty-segment": "segment-header",   # a new segment file created, its header not written
    "recovery-unsealed": "recovery-seal",  # at start: a torn tail cut off, the segment not sealed
    "log-unrenamed": "log-rename",       # at start: the new index log generation not renamed in
    "log-renamed": "log-renamed",        # at start: renamed in, the older generation not deleted
}


def chain_keys(n: int) -> list[bytes]:
    return chain(CHAIN_BLOCKS, seed=n)


def page(key: bytes) -> tuple[TensorDesc, memoryview]:
    desc, tile = page_for(key)
    return TensorDesc(desc.dtype, (desc.shape[0] * PAGE_TILES,)), memoryview(bytes(tile) * PAGE_TILES)


def die(point: str) -> None:
    print(f"killing at {point}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


class KillPoint:
    def __init__(self, spec: str):
        self.name, _, nth = spec.partition(":")
        if self.name not in POINTS:
            raise SystemExit(f"unknown kill point {self.name!r} (one of {sorted(POINTS)})")
        self.event, self.nth, self.seen = POINTS[self.name], int(nth or 1), 0

    def reached(self, event: str) -> bool:
        if event != self.event:
            return False
        self.seen += 1
        return self.seen == self.nth


def _bytes(buf, limit: int | None = None) -> bytes:
    return memoryview(buf).cast("B")[:limit].tobytes()


def arm(spec: str) -> None:
    """Wrap the store's functions so the process dies at the point `spec` names ("point:N")."""
    point = KillPoint(spec)
    recovering = [False]
    real_pwrite, real_publish, real_append = PosixIO.pwrite, SegmentStore._publish, IndexLogWriter.append
    real_recover, real_rename, real_fsync_dir = kvstore.space.recover_segment, os.rename, kvstore.indexlog._fsync_dir

    def pwrite(self, fd, offset, buffers):
        first = _bytes(buffers[0], 8)
        if len(buffers) == 2 and first[:4] == fmt.RECORD_MAGIC and point.reached("record"):
            header, payload = _bytes(buffers[0]), _bytes(buffers[1])
            torn = header[:len(header) // 2] if point.name == "torn-record-header" else \
                header + payload[:len(payload) // 2]
            os.pwrite(fd, torn, offset)
            die(point.name)
        if len(buffers) == 2 and _bytes(buffers[1], 8) == fmt.TRAILER_MAGIC:
            if point.reached("recovery-seal" if recovering[0] else "seal"):
                if point.name == "torn-seal":
                    os.pwrite(fd, _bytes(buffers[0]), offset)
                elif point.name == "sealed-unsynced":
                    real_pwrite(self, fd, offset, buffers)
                die(point.name)
        if offset == 0 and first == fmt.SEGMENT_MAGIC and point.reached("segment-header"):
            die(point.name)
        return real_pwrite(self, fd, offset, buffers)

    def publish(self, entries):
        if point.reached("publish"):
            die(point.name)
        real_publish(self, entries)
        if point.reached("published"):
            die(point.name)

    def append(self, entries):
        if point.reached("log-append"):
            data = fmt.encode_entries(fmt.entry_array(entries))
            os.pwrite(self.fd, data[:len(data) - fmt.ENTRY_SIZE // 2], self.size)
            die(point.name)
        real_append(self, entries)

    def recover(*args, **kwargs):
        recovering[0] = True
        try:
            return real_recover(*args, **kwargs)
        finally:
            recovering[0] = False

    def rename(src, dst, *args, **kwargs):
        if fmt.parse_log_name(os.path.basename(dst)) is not None and point.reached("log-rename"):
            die(point.name)
        return real_rename(src, dst, *args, **kwargs)

    def fsync_dir(path):
        real_fsync_dir(path)
        if point.reached("log-renamed"):
            die(point.name)

    PosixIO.pwrite, SegmentStore._publish, IndexLogWriter.append = pwrite, publish, append
    kvstore.space.recover_segment, os.rename, kvstore.indexlog._fsync_dir = recover, rename, fsync_dir


def write(root: str, first: int, fsync: str, kill: str = "", count: int = 0) -> int:
    if kill:
        arm(kill)
    store = SegmentStore(StoreSettings(root=root, segment_bytes=SEGMENT_BYTES, fsync=fsync))
    s = store.stats
    print(f"started records={len(store)} recovered={s.segments_recovered} segments={store.segment_count}", flush=True)
    for n in range(first, first + (count if not kill else RUNAWAY_CHAINS)):
        store.write([(k, page(k)) for k in chain_keys(n)])
        print(f"wrote {n}", flush=True)
    store.close()
    return 3 if kill else 0


def serve() -> int:
    from services.runtime.main import main
    kill = os.environ.get("EPD_TEST_KILL_AT", "")
    if kill:
        arm(kill)
    return main([])


# ---- the reader's side, for the tests ----------------------------------------------------------
@dataclass
class Ledger:
    confirmed: set[int] = field(default_factory=set)   # chains whose write returned (published)
    highest: int = -1                                  # the last chain a writer may have begun


class ConcurrentReader(threading.Thread):
    """A StoreReader looking at every chain over and over while writers run, die and restart."""

    def __init__(self, root: str, ledger: Ledger):
        super().__init__(daemon=True)
        self.root, self.ledger = root, ledger
        self.failures: list[str] = []
        self.pages_checked = 0
        self.corrupt_records = 0
        self.done = threading.Event()

    def run(self) -> None:
        try:
            with StoreReader(self.root, read_threads=0) as reader:
                while not self.done.is_set():
                    for n in range(self.ledger.highest + 2):
                        self.pages_checked += check_chain(reader, n, n in self.ledger.confirmed, self.failures)
                    self.corrupt_records = reader.corrupt_records
                    self.done.wait(0.002)   # pacing only: leave the writer a core
        except Exception as exc:   # a reader that fails is a finding, not a test crash
            self.failures.append(f"reader raised {exc!r}")


def check_chain(reader, n: int, confirmed: bool, failures: list[str]) -> int:
    """The chain's served pages are exactly the bytes written; a confirmed chain is served whole."""
    keys = chain_keys(n)
    pages = reader.read(keys)
    for i, (key, got) in enumerate(zip(keys, pages)):
        if not same_bits(got, page(key)):
            failures.append(f"chain {n} block {i}: bytes differ from those written")
    if confirmed and len(pages) != CHAIN_BLOCKS:
        failures.append(f"chain {n} was published, {len(pages)} of {CHAIN_BLOCKS} blocks served")
    return len(pages)


# ---- what a crash leaves on disk ----------------------------------------------------------------
def segments(root: str) -> list[int]:
    return sorted(s for s in map(fmt.parse_segment_name, os.listdir(os.path.join(root, "segments"))) if s is not None)


def scan(root: str, seq: int) -> ScanResult:
    return scan_segment(PosixIO(), segment_path(root, seq), seq)


def record_cut_in_half(root: str) -> None:
    last = scan(root, segments(root)[-1])
    assert not last.sealed and last.problem and last.size > last.end, last


def published_in(root: str, seq: int) -> int:
    """PUT entries for segment `seq` in the newest index log (what readers were told)."""
    tail = IndexLogTail(root)
    try:
        _, entries = tail.poll()
    finally:
        tail.close()
    return int(((entries["kind"] == fmt.PUT) & (entries["seq"] == seq)).sum())


def records_whole_but_unpublished(root: str) -> None:
    seq = segments(root)[-1]
    last = scan(root, seq)
    assert not last.sealed and not last.problem and len(last.entries) > published_in(root, seq)


def assert_all_sealed(root: str) -> None:
    """After a restart: the partial data is cut off and every segment sealed."""
    for seq in segments(root):
        found = scan(root, seq)
        assert found.sealed and not found.problem, (seq, found)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        sys.exit(serve())
    root, first, fsync, *rest = sys.argv[2:]
    sys.exit(write(root, int(first), fsync, rest[0] if rest else "", int(rest[1]) if len(rest) > 1 else 0))
