"""The kv_writer service process SIGKILLed while block writes stream in, then restarted at the same
address and root.

Writes come as the decode workers send them (services/workers/persist.py): one-way KvWritePages,
one buffer frame per page, no ack. The kill is either plain (SIGKILL from outside once a burst of
writes is on its way) or injected at an exact point of the write path (kill_point_helper.py runs the
real service with the store's functions wrapped): in the middle of a record, or after a record's
data and before its index publish. Throughout, a StoreReader (what the prefill router and prefill
workers read with) checks every page it is served against the bytes written. After the restart,
lookups of every block published before the kill still hit, no torn record is served, and new
writes (the same client, its connection re-made) are stored and served."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from kvstore import StoreReader
from messages.common import TrafficClass
from messages.control import ServiceState
from messages.kv_store import KvLookup, KvReadPages, KvWritePages
from services.runtime.config import ServiceConfig
from services.runtime.service import Service
from tests.helpers.test_helper_async import eventually
from tests.helpers.test_helper_processes import REPO, ServiceProcess, tcp_config
from tests.kvstore.common import same_bits
from tests.kvstore.kill_point_helper import (CHAIN_BLOCKS, RUNAWAY_CHAINS, SEGMENT_BYTES, ConcurrentReader, Ledger,
                                             assert_all_sealed, chain_keys, page, record_cut_in_half,
                                             records_whole_but_unpublished, scan, segments)

pytestmark = pytest.mark.slow   # starts kv_writer processes

LAYOUT = "v4"
PUBLISHED_FIRST = 3     # chains published (seen by a reader) before the kill
BURST = 6               # chains sent at once right before a plain kill: writes in flight when it lands
NEW_CHAINS = 3          # chains sent after the restart
CALL_TIMEOUT_S = 10.0   # covers the client's reconnect back-off while the writer was down


class KillPointService(ServiceProcess):
    """The real kv_writer service, run by kill_point_helper armed to SIGKILL itself at `kill_at`."""

    def __init__(self, config: ServiceConfig, log_dir: Path, kill_at: str):
        self.config = config
        self.log_path = log_dir / f"{config.instance}.log"
        env = {**os.environ, **config.to_env(), "PYTHONUNBUFFERED": "1", "EPD_TEST_KILL_AT": kill_at}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.kvstore.kill_point_helper", "serve"], env=env,
                                         cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


@asynccontextmanager
async def client_service(tmp_path):
    client = Service(ServiceConfig(kind="echo", instance="client", bind=f"ipc://{tmp_path}/client.sock"))
    task = asyncio.create_task(client.run(install_signals=False))
    try:
        await eventually(lambda: client.state == ServiceState.RUNNING, what="client running")
        yield client
    finally:
        client.stop()
        assert await task == 0


def persist_chain(client: Service, address: str, n: int) -> None:
    """What a decode worker sends for a request's completed blocks: one-way, pages as frames."""
    keys = chain_keys(n)
    client.send(address, KvWritePages(keys, list(range(len(keys))), LAYOUT, TrafficClass.CHATBOT),
                buffers=[page(k) for k in keys])


async def start(process: ServiceProcess) -> ServiceProcess:
    await asyncio.to_thread(process.wait_running)
    return process


async def assert_served_exactly(client: Service, address: str, n: int, whole: bool) -> int:
    """Through the service: the lookup hit and the pages read back are the bytes written."""
    keys = chain_keys(n)
    hit = (await client.call(address, KvLookup(keys), timeout=CALL_TIMEOUT_S)).message.hit_blocks
    envelope = await client.call(address, KvReadPages(keys, LAYOUT), timeout=CALL_TIMEOUT_S)
    assert envelope.message.found == hit and (hit == CHAIN_BLOCKS or not whole), f"chain {n}: {hit} blocks hit"
    assert all(same_bits(envelope.frame(i), page(keys[i])) for i in range(hit)), f"chain {n}: wrong bytes"
    return hit


async def write_until_the_kill(client: Service, address: str, writer: ServiceProcess, probe: StoreReader,
                               ledger: Ledger, kill_at: str | None) -> int:
    """Persist chains one at a time, each until a reader sees it, and get the writer killed: by
    itself at its kill point, or from outside right after a burst of writes; returns the chain
    being written when it died."""
    n = 0
    while n < PUBLISHED_FIRST or kill_at is not None:
        assert n < RUNAWAY_CHAINS, f"the kill point {kill_at} was never reached"
        ledger.highest = n
        persist_chain(client, address, n)
        await eventually(lambda: probe.lookup(chain_keys(n)) == CHAIN_BLOCKS or writer.proc.poll() is not None,
                         timeout=CALL_TIMEOUT_S, what=f"chain {n} published")
        if writer.proc.poll() is not None:
            break
        ledger.confirmed.add(n)
        n += 1
    if kill_at is None:
        ledger.highest = n + BURST - 1
        for m in range(n, n + BURST):
            persist_chain(client, address, m)
        await eventually(lambda: probe.lookup(chain_keys(n)) == CHAIN_BLOCKS, what="the burst being written")
        writer.proc.send_signal(signal.SIGKILL)
    assert await asyncio.to_thread(writer.proc.wait) == -signal.SIGKILL
    return n


# kill: None = plain SIGKILL from outside; else the kill point, what it leaves on disk, and how many
# blocks of the chain being written when it fired the restart keeps (the whole records before the cut)
CASES = {
    "sigkill-during-a-burst": (None, None, None),
    "killed-mid-record": ("torn-record-payload:11", record_cut_in_half, 2),
    "killed-between-data-and-publish": ("before-publish:3", records_whole_but_unpublished, CHAIN_BLOCKS),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
async def test_a_killed_kv_writer_restarts_with_its_published_blocks_and_never_serves_a_torn_one(tmp_path, case):
    kill_at, on_disk, in_flight_kept = CASES[case]
    root = str(tmp_path / "store")
    config = tcp_config("kv_writer", "kv", settings={"root": root, "segment_bytes": SEGMENT_BYTES, "fsync": "batch"})
    address = config.advertise
    ledger = Ledger()
    reader = ConcurrentReader(root, ledger)
    logs = [tmp_path / "first", tmp_path / "restarted"]
    for folder in logs:
        folder.mkdir()
    first = ServiceProcess(config, logs[0]) if kill_at is None else KillPointService(config, logs[0], kill_at)
    processes = [await start(first)]
    reader.start()
    try:
        async with client_service(tmp_path) as client:
            with StoreReader(root, read_threads=0) as probe:   # a reader's view: published = in the index log
                in_flight = await write_until_the_kill(client, address, first, probe, ledger, kill_at)
                if kill_at is not None:
                    assert f"killing at {kill_at.partition(':')[0]}" in first.log() and len(ledger.confirmed) >= 2
                    on_disk(root)
                # A kill point dies with a segment open; a plain SIGKILL may also land between sealing a
                # full segment and opening the next (seen on a loaded box), with nothing to recover then.
                died_open = not scan(root, segments(root)[-1]).sealed
                assert died_open or kill_at is None

                restarted = await start(ServiceProcess(config, logs[1]))   # same address, same root
                processes.append(restarted)
                for m in sorted(ledger.confirmed):
                    await assert_served_exactly(client, address, m, whole=True)
                kept = await assert_served_exactly(client, address, in_flight, whole=False)
                if in_flight_kept is not None:
                    assert kept == in_flight_kept, "the restart kept a cut record or lost a whole one"
                assert_all_sealed(root)
                assert ("kv_store.segment_recovered" in restarted.log()) == died_open

                resumed = range(in_flight, ledger.highest + 1 + NEW_CHAINS)   # what was lost, then new chains
                ledger.highest = resumed[-1]
                for m in resumed:
                    persist_chain(client, address, m)
                for m in resumed:
                    await eventually(lambda: probe.lookup(chain_keys(m)) == CHAIN_BLOCKS, timeout=CALL_TIMEOUT_S,
                                     what=f"chain {m} stored after the restart")
                    ledger.confirmed.add(m)
                    await assert_served_exactly(client, address, m, whole=True)
                assert restarted.proc.poll() is None
    finally:
        reader.done.set()
        await asyncio.to_thread(reader.join, 30)
        for process in processes:
            process.stop()
    assert not reader.failures, reader.failures[:5]
    assert reader.corrupt_records == 0 and reader.pages_checked > 0

