"""The decode router restarted at its address (in-process, real ZeroMQ): it starts knowing nobody,
and rebuilds its load table from the decode workers, which re-register when a heartbeat is answered
`known=False`: complete again, loads included, within a few heartbeat intervals. Meanwhile the
prefill router keeps routing on the table it last fetched, and afterwards routes on the new one."""
from __future__ import annotations

import time

import pytest

from messages.control import Load
from messages.routing import DecodeTableQuery
from services.decode_router.service import DecodeRouterService
from services.prefill_router.service import PrefillRouterService
from services.runtime.service import Service
from tests.decode_router.test_service import TestHelperDecodeWorker
from tests.helpers.test_helper_async import eventually
from tests.prefill_router.test_service import TestHelperGateway, TestHelperPrefillWorker
from tests.swa_registry.test_helper_restarts import RestartableServices

TIMING = {"heartbeat_s": 0.1, "dead_after": 3}
LOADS = {"dw0": Load(batch_size=6, kv_usage=0.8, capacity=8), "dw1": Load(batch_size=1, kv_usage=0.1, capacity=8),
         "dw2": Load(batch_size=4, kv_usage=0.5, capacity=8)}      # dw1 is the best choice


@pytest.fixture
async def stack(tmp_path):
    s = RestartableServices(tmp_path, TIMING)
    s.decode_router = await s.start(DecodeRouterService, "dr")
    s.decoders = []
    for name, load in LOADS.items():
        worker = await s.start(TestHelperDecodeWorker, name, upstream=s.decode_router.config.advertise)
        worker.fixed_load = load
        s.decoders.append(worker)
    s.router = await s.start(PrefillRouterService, "pr", {"decode_router": s.decode_router.config.advertise,
                                                         "decode_table_interval_s": 0.05})
    s.worker = await s.start(TestHelperPrefillWorker, "pw", upstream=s.router.config.advertise)
    s.gateway = await s.start(TestHelperGateway, "gw", upstream=s.router.config.advertise)
    s.client = await s.start(Service, "client")
    await eventually(lambda: table_complete(s.decode_router) and len(s.router.members.alive("prefill_worker")) == 1,
                     what="stack up")
    await tables_fetched(s.decode_router)
    yield s
    await s.close()


def table_complete(router: DecodeRouterService) -> bool:
    """Every decode worker listed, with the load it reports."""
    return {w.instance: w.load for w in router.table().workers} == LOADS


async def tables_fetched(router: DecodeRouterService) -> None:
    """Wait until the prefill router fetched a table that was asked for after now."""
    start = router.tables_sent
    await eventually(lambda: router.tables_sent >= start + 2, what="a fresh table fetched")


async def routed_to(s, rid: str) -> str:
    s.gateway.generate(rid, 300)
    await eventually(lambda: rid in s.worker.rids(), what=f"{rid} dispatched")
    return next(w.decode_address for r, w in s.worker.works if r == rid)


async def test_a_restarted_decode_router_rebuilds_its_table_and_new_requests_route(stack):
    s = stack
    best = s.decoders[1].config.advertise
    assert await routed_to(s, "before") == best

    await s.stop(s.decode_router)
    # while it is away the prefill router routes on the table it last fetched (until it is stale)
    assert await routed_to(s, "during") == best

    s.decode_router = await s.start_again("dr")            # same address, a new process: an empty table
    restarted = time.monotonic()
    await eventually(lambda: table_complete(s.decode_router), timeout=5, what="the table rebuilt")
    rebuilt_s = time.monotonic() - restarted
    # a heartbeat answered known=False, the upstream link's first back-off (0.25 s), a registration
    assert rebuilt_s < 0.25 + 5 * TIMING["heartbeat_s"] + 0.5, f"table rebuilt in {rebuilt_s:.2f} s"
    assert all(s.decode_router.members.get(name).alive for name in LOADS)
    table = (await s.client.call(s.decode_router.config.advertise, DecodeTableQuery())).message
    assert sorted(w.instance for w in table.workers) == sorted(LOADS)

    # the prefill router takes the new table and routes on it
    s.decoders[1].fixed_load = Load(batch_size=7, kv_usage=0.9, capacity=8)   # now dw2 is best
    await eventually(lambda: s.decode_router.members.get("dw1").load.kv_usage == 0.9, what="load heard")
    await tables_fetched(s.decode_router)
    assert s.router.decode.workers() == 3 and s.router.decode.fresh()
    assert await routed_to(s, "after") == s.decoders[2].config.advertise
