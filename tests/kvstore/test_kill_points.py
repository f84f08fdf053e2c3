"""A KV writer SIGKILLed at each dangerous point of its write path (kill_point_helper.py injects the
kill from outside the store's code): in the middle of a record, after the data but before the index
publish, inside an index log entry, after the publish but before the fsync of a seal, while a new
segment or a new index log generation is being made, and during the recovery at the next start.

For each: the dangerous state is first shown to be on disk (a cut record, a footer without trailer,
...); a StoreReader running all along (as the prefill router and workers run one) and one opened
after the restart never serve a byte that differs from what was written and never fail; every
chain whose write returned stays whole; the restarted writer leaves every segment sealed with the
partial data cut off, and its new writes are served."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from kvstore import StoreReader
from kvstore import record as fmt
from kvstore.indexlog import generations
from kvstore.segment import segment_path
from tests.kvstore.kill_point_helper import (ConcurrentReader, Ledger, assert_all_sealed, check_chain, published_in,
                                            record_cut_in_half, records_whole_but_unpublished, scan, segments)

pytestmark = pytest.mark.slow   # starts writer processes

ROOT = Path(__file__).resolve().parents[2]
NEW_CHAINS = 3                   # written by the clean restart: new writes work


def records_published_segment_unsealed(root: str) -> None:
    seq = segments(root)[-1]
    last = scan(root, seq)
    assert not last.sealed and not last.problem and len(last.entries) == published_in(root, seq)


def log_entry_cut(root: str) -> None:
    size = os.path.getsize(os.path.join(root, fmt.log_name(generations(root)[-1])))
    assert (size - fmt.LOG_HEADER_SIZE) % fmt.ENTRY_SIZE == fmt.ENTRY_SIZE // 2


def footer_without_trailer(root: str) -> None:
    first = scan(root, 0)
    assert not first.sealed and first.size > first.end and len(segments(root)) == 1


def sealed_first_segment(root: str) -> None:
    assert scan(root, 0).sealed and len(segments(root)) == 1


def empty_new_segment(root: str) -> None:
    assert scan(root, 0).sealed and os.path.getsize(segment_path(root, 1)) == 0


def tail_cut_not_sealed(root: str) -> None:
    last = scan(root, segments(root)[-1])
    assert not last.sealed and not last.problem and last.size == last.end


def snapshot_left_unrenamed(root: str) -> None:
    assert any(name.endswith(".log.tmp") for name in os.listdir(root)) and len(generations(root)) == 1


def two_generations(root: str) -> None:
    assert len(generations(root)) == 2


@dataclass(frozen=True)
class Scenario:
    fsync: str
    kills: tuple[str, ...]                 # one writer start per kill point, in order
    on_disk: Callable[[str], None]         # checked after the last kill
    in_flight_after: int                   # blocks of the chain being written that the restart keeps


SCENARIOS = {
    "torn-record-header": Scenario("batch", ("torn-record-header:11",), record_cut_in_half, 2),
    "torn-record-payload": Scenario("batch", ("torn-record-payload:11",), record_cut_in_half, 2),
    "torn-record-payload-fsync-always": Scenario("always", ("torn-record-payload:11",), record_cut_in_half, 2),
    "written-not-published": Scenario("batch", ("before-publish:3",), records_whole_but_unpublished, 4),
    "published-not-fsynced": Scenario("none", ("after-publish:3",), records_published_segment_unsealed, 4),
    "torn-index-log-entry": Scenario("batch", ("torn-log-entry:3",), log_entry_cut, 4),
    "torn-seal": Scenario("batch", ("torn-seal:1",), footer_without_trailer, 3),
    "sealed-not-fsynced": Scenario("batch", ("sealed-unsynced:1",), sealed_first_segment, 3),
    "new-segment-empty": Scenario("batch", ("empty-segment:2",), empty_new_segment, 3),
    "killed-again-during-recovery": Scenario("batch", ("torn-record-payload:11", "recovery-unsealed:1"),
                                             tail_cut_not_sealed, 2),
    "killed-before-log-rename": Scenario("batch", ("torn-record-payload:11", "log-unrenamed:1"),
                                         snapshot_left_unrenamed, 2),
    "killed-after-log-rename": Scenario("batch", ("torn-record-payload:11", "log-renamed:1"), two_generations, 2),
}


def run_writer(root: str, first: int, fsync: str, kill: str = "", count: int = 0, ledger: Ledger | None = None):
    """One writer process to its end; returns (exit code, its output lines)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "tests.kvstore.kill_point_helper", "write", root, str(first), fsync,
                             kill, str(count)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                            text=True)
    lines = []
    with proc.stdout:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if ledger is not None and line.startswith("wrote "):
                n = int(line.split()[1])
                ledger.confirmed.add(n)
                ledger.highest = max(ledger.highest, n + 1)
    return proc.wait(timeout=60), lines


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_writer_killed_at_a_dangerous_point_never_serves_a_torn_block_and_recovers(tmp_path, name):
    scenario = SCENARIOS[name]
    root = str(tmp_path / "store")
    ledger = Ledger()
    reader = ConcurrentReader(root, ledger)
    reader.start()
    try:
        first = 0
        for kill in scenario.kills:
            ledger.highest = max(ledger.highest, first)
            rc, lines = run_writer(root, first, scenario.fsync, kill, ledger=ledger)
            point = kill.partition(":")[0]
            assert rc == -signal.SIGKILL and lines[-1] == f"killing at {point}", "\n".join(lines)
            in_flight = max(ledger.confirmed, default=-1) + 1
            first = in_flight + 1
        scenario.on_disk(root)
        assert ledger.confirmed, "no write was published before the kill"

        with StoreReader(root, read_threads=0) as before_restart:   # opened while no writer runs
            for n in range(first + 1):
                check_chain(before_restart, n, n in ledger.confirmed, reader.failures)
            assert before_restart.corrupt_records == 0

        rc, lines = run_writer(root, first, scenario.fsync, count=NEW_CHAINS, ledger=ledger)
        assert rc == 0, "\n".join(lines)
        assert set(range(first, first + NEW_CHAINS)) <= ledger.confirmed   # new writes work

        with StoreReader(root, read_threads=0) as after_restart:
            for n in range(first + NEW_CHAINS + 1):
                served = check_chain(after_restart, n, n in ledger.confirmed, reader.failures)
                if n == in_flight:   # the whole records before the cut, not one more
                    assert served == scenario.in_flight_after, "the restart kept a cut record or lost a whole one"
            assert after_restart.corrupt_records == 0
        assert_all_sealed(root)
        assert len(generations(root)) == 1 and not [n for n in os.listdir(root) if n.endswith(".tmp")]
    finally:
        reader.done.set()
        reader.join(timeout=30)
    assert not reader.failures, reader.failures[:5]
    assert reader.corrupt_records == 0 and reader.pages_checked > 0
