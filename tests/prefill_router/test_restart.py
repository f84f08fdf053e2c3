"""The prefill router restarted at its address (in-process, real ZeroMQ): it starts knowing no rank
and no gateway, and rebuilds both from their registrations (each re-registers when a heartbeat is
answered `known=False`) and the decode table from the decode router, within a few heartbeat
intervals; then requests route again, with the store's hit and the best decode worker."""
from __future__ import annotations

import time

import pytest

from kvstore import SegmentStore, StoreSettings
from messages.control import Load
from services.decode_router.service import DecodeRouterService
from services.prefill_router.service import PrefillRouterService
from tests.decode_router.test_service import TestHelperDecodeWorker
from tests.helpers.test_helper_async import eventually
from tests.prefill_router.test_service import TestHelperGateway, TestHelperPrefillWorker, h
from tests.kvstore.common import pages_of
from tests.swa_registry.test_helper_restarts import RestartableServices

TIMING = {"heartbeat_s": 0.1, "dead_after": 3}


@pytest.fixture
async def stack(tmp_path):
    with SegmentStore(StoreSettings(root=str(tmp_path / "kvstore"))) as store:
        store.write(pages_of([h(i) for i in range(3)]))          # a 384-token prefix is stored
        s = RestartableServices(tmp_path, TIMING)
        s.decode_router = await s.start(DecodeRouterService, "dr")
        s.decoders = [await s.start(TestHelperDecodeWorker, f"dw{i}", upstream=s.decode_router.config.advertise)
                      for i in range(2)]
        s.decoders[0].fixed_load = Load(batch_size=3, kv_usage=0.7, capacity=8)
        s.router = await s.start(PrefillRouterService, "pr", {
            "kv_store_dir": store.root, "decode_router": s.decode_router.config.advertise,
            "decode_table_interval_s": 0.05})
        s.ranks = [await s.start(TestHelperPrefillWorker, f"pw{i}", upstream=s.router.config.advertise)
                   for i in range(2)]
        s.gateway = await s.start(TestHelperGateway, "gw", upstream=s.router.config.advertise)
        await eventually(lambda: rebuilt(s.router), what="stack up")
        yield s
        await s.close()


def rebuilt(router: PrefillRouterService) -> bool:
    """Both ranks and the gateway registered, and a fresh decode table with both decode workers."""
    return (len(router.members.alive("prefill_worker")) == 2 and len(router.members.alive("gateway")) == 1
            and router.decode.fresh() and router.decode.workers() == 2)


def works(s) -> dict:
    return {rid: work for rank in s.ranks for rid, work in rank.works}


async def test_a_restarted_prefill_router_rebuilds_its_ranks_and_routes_new_requests(stack):
    s = stack
    s.gateway.generate("before", 600)
    await eventually(lambda: "before" in works(s), what="routed before the restart")

    s.router = await s.restart(s.router)                   # same address, a new process: knows nobody
    assert len(s.router.members.alive()) == 0
    restarted = time.monotonic()
    await eventually(lambda: rebuilt(s.router), timeout=5, what="ranks, gateway and decode table rebuilt")
    rebuilt_s = time.monotonic() - restarted
    # a heartbeat answered known=False, the upstream link's first back-off (0.25 s), a registration
    assert rebuilt_s < 0.25 + 5 * TIMING["heartbeat_s"] + 0.5, f"rebuilt in {rebuilt_s:.2f} s"

    for i in range(4):
        s.gateway.generate(f"after-{i}", 600)
    await eventually(lambda: all(f"after-{i}" in works(s) for i in range(4)), what="routed after the restart")
    routed = [works(s)[f"after-{i}"] for i in range(4)]
    assert all(work.kv_hit_tokens == 384 for work in routed)                     # the store's hit
    assert {work.decode_address for work in routed} <= {d.config.advertise for d in s.decoders}
    assert routed[0].decode_address == s.decoders[1].config.advertise          # the idle decode worker
    await eventually(lambda: s.router.core.outstanding() == 0 and s.router.core.stats.finished == 4,
                     what="every PrefillDone taken by the restarted router")
