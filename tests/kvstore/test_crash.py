"""SIGKILL during heavy writes: a writer process writes chains continuously while a reader in this
process tails the index log; the writer is killed -9 mid-way, restarted, killed again. After each
restart the index is rebuilt from the segments, every chain whose write returned is still whole, every
lookup hit reads back exactly the bytes written, and nothing corrupt is ever served."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore import SegmentStore, StoreReader, StoreSettings
from tests.kvstore import crash_writer
from tests.kvstore.common import chain, same_bits

pytestmark = pytest.mark.slow   # starts service processes

ROOT = Path(__file__).resolve().parents[2]
POLICIES = ("batch", "none", "always")   # one writer process per policy, each killed -9
CHAINS_PER_ROUND = 8


def start_writer(root: str, first: int, fsync: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-m", "tests.kvstore.crash_writer", root, str(first), fsync],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, env=env)


def keys_of(n: int) -> list[bytes]:
    return chain(crash_writer.CHAIN_BLOCKS, seed=n)


def assert_serves_exactly_what_was_written(reader, n: int) -> int:
    keys = keys_of(n)
    hit = reader.lookup(keys)
    pages = reader.read(keys)
    assert len(pages) == hit, f"chain {n}: lookup says {hit}, {len(pages)} read back"
    for key, page in zip(keys, pages):
        assert same_bits(page, crash_writer.crash_page(key)), f"chain {n}: wrong bytes served"
    return hit


@pytest.mark.timeout(240)
def test_sigkill_during_heavy_writes_keeps_every_published_record_and_serves_nothing_corrupt(tmp_path):
    root = str(tmp_path / "store")
    rng = random.Random(0)
    settings = StoreSettings(root=root, segment_bytes=crash_writer.SEGMENT_BYTES)
    confirmed: set[int] = set()
    first = 0
    reader = None
    for round_, fsync in enumerate(POLICIES):
        proc = start_writer(root, first, fsync)
        last = first - 1
        try:
            while last < first + CHAINS_PER_ROUND:
                line = proc.stdout.readline().decode()
                assert line, f"writer died: {proc.wait()}"
                if not line.startswith("wrote "):
                    continue
                last = int(line.split()[1])
                confirmed.add(last)
                if reader is None:
                    reader = StoreReader(root)
                reader.refresh()   # published before the write returned: the reader sees the whole chain
                assert assert_serves_exactly_what_was_written(reader, last) == crash_writer.CHAIN_BLOCKS
            time.sleep(rng.uniform(0, 0.02))   # land the kill anywhere in the next writes
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc.stdout.close()

        with SegmentStore(settings) as store:
            assert store.stats.corrupt_records == 0      # (the unsealed segment was verified and sealed)
            for n in range(0, last + 3):   # chains confirmed, the ones in flight, and one never begun
                hit = assert_serves_exactly_what_was_written(store, n)
                if n in confirmed:
                    assert hit == crash_writer.CHAIN_BLOCKS, f"chain {n} was published, then lost"
            assert store.stats.corrupt_records == 0 and store.stats.read_misses == 0
            reader.refresh()   # the restarted writer published a new index log generation
            assert reader.generation == 2 * (round_ + 1)   # one per start: writer process, then this store
            for n in rng.sample(sorted(confirmed), 5):
                assert assert_serves_exactly_what_was_written(reader, n) == crash_writer.CHAIN_BLOCKS
        first = last + 3
    assert reader.corrupt_records == 0
    reader.close()
