"""SwaRegistryService and the workers' side of it (the real BlockPersister, in a test-only holder
without an engine) over real ZeroMQ, in-process, through restarts: check-ins answered with the
registry's incarnation and `known`; a worker restarted at its address retires its predecessor's
entries at its first check-in, so no fetch reaches it for windows it never had; a silent holder
loses its entries; a restarted registry (quickly, or after the workers gave it up, or answering
slower than a heartbeat interval) is filled again by the workers with every window they still hold."""
from __future__ import annotations

import asyncio
import time

import pytest

from messages.handoff import SwaFetch, SwaState
from messages.swa_registry import SwaLookup, SwaRegister
from services.runtime.service import Service
from services.swa_registry.service import SwaRegistryService
from tests.helpers.test_helper_async import eventually
from tests.swa_registry.test_helper_restarts import RestartableServices
from tests.swa_registry.test_helper_window_holder import TestHelperWindowHolder

TIMING = {"heartbeat_s": 0.1, "dead_after": 3}


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


@pytest.fixture
async def services(tmp_path):
    s = RestartableServices(tmp_path, TIMING)
    s.registry = await s.start(SwaRegistryService, "swa")
    s.client = await s.start(Service, "client")
    yield s
    await s.close()


async def holder(s: RestartableServices, name: str, *held: int) -> TestHelperWindowHolder:
    """A worker that computed (and advertised) the windows `held`; restarted, it holds none."""
    worker = await s.start(TestHelperWindowHolder, name, {"swa_registry": s.registry.config.advertise})
    await eventually(lambda: worker.persister.registry_incarnation == s.registry.incarnation,
                     what=f"{name} checked in")
    worker.hold([h(i) for i in held])
    return worker


async def holders_of(s: RestartableServices, *indices: int) -> list[str]:
    return (await s.client.call(s.registry.config.advertise, SwaLookup([h(i) for i in indices]))).message.holders


async def fetch(s: RestartableServices, *indices: int):
    return await s.client.call(s.registry.config.advertise, SwaFetch([h(i) for i in indices], s.client.config.advertise,
                                                                     requester_incarnation=s.client.incarnation),
                               timeout=2.0)


async def test_a_check_in_is_answered_with_the_registrys_incarnation_and_whether_it_knew_the_worker(services):
    s, address = services, services.registry.config.advertise
    check_in = SwaRegister([], "tcp://w:1", ack=True, incarnation="feedfacefeedface")
    first = (await s.client.call(address, check_in)).message
    assert (first.count, first.registry_incarnation, first.known) == (0, s.registry.incarnation, False)
    assert (await s.client.call(address, check_in)).message.known


async def test_a_restarted_worker_retires_its_predecessors_windows_at_its_first_check_in(services):
    s = services
    b = await holder(s, "b", 1, 2)
    a = await holder(s, "a", 1, 2, 3)                      # registered last: named first
    await eventually(lambda: s.registry.registry.lookup([h(1), h(2), h(3)]) == [a.config.advertise] * 3,
                     what="a's windows registered")
    a = await s.restart(a)                                 # same address, holds nothing now
    await eventually(lambda: a.persister.registry_incarnation, what="the new process checked in")
    assert await holders_of(s, 1, 2, 3) == [b.config.advertise] * 2 + [""]
    assert (await fetch(s, 3, 2)).message == SwaState(True, 128, prefix_hash=h(2))   # from b
    assert a.fetches == [] and [f.prefix_hashes for f in b.fetches] == [[h(2)]]
    assert (await fetch(s, 3)).header.sender == "swa"     # nobody holds it: answered by the registry
    assert a.fetches == []
    metric = s.registry.metrics.registry.get_sample_value
    labels = {"kind": "swa_registry", "instance": "swa"}
    assert metric("epd_swa_restarts_total", labels) == 1 and metric("epd_swa_dropped_total", labels) == 3
    assert metric("epd_swa_holder_processes", labels) == 2


async def test_a_silent_holders_windows_are_no_longer_offered(services):
    s = services
    a = await holder(s, "a", 1)
    await eventually(lambda: s.registry.registry.lookup([h(1)]) == [a.config.advertise], what="registered")
    await s.stop(a)                                        # dead, and no new process at its address
    stopped = time.monotonic()
    await eventually(lambda: s.registry.registry.lookup([h(1)]) == [""], timeout=5, what="silent holder dropped")
    assert time.monotonic() - stopped < 3 * TIMING["heartbeat_s"] * TIMING["dead_after"] + 0.5
    reply = await fetch(s, 1)
    assert (reply.header.sender, reply.message) == ("swa", SwaState(found=False))


async def test_a_restarted_registry_is_filled_again_by_the_workers(services):
    s = services
    a, b = await holder(s, "a", 1, 2), await holder(s, "b", 3)
    await eventually(lambda: s.registry.registry.lookup([h(1), h(2), h(3)]) ==
                     [a.config.advertise] * 2 + [b.config.advertise], what="registered")
    old = s.registry.incarnation
    s.registry = await s.restart(s.registry)
    restarted = time.monotonic()
    await eventually(lambda: s.registry.registry.lookup([h(1), h(2), h(3)]) ==
                     [a.config.advertise] * 2 + [b.config.advertise], timeout=5, what="registered again")
    assert time.monotonic() - restarted < 5 * TIMING["heartbeat_s"] + 0.5
    assert a.persister.registry_incarnation == s.registry.incarnation != old
    assert a.persister.reregistrations == 2                 # at its start, and after the restart
    reply = await fetch(s, 2)
    assert (reply.header.sender, reply.message.prefix_hash) == ("a", h(2))


async def test_windows_computed_while_the_registry_was_down_are_registered_when_it_returns(services):
    s = services
    a = await holder(s, "a", 1)
    await s.stop(s.registry)
    # the registry stays away past dead_after check-ins: the worker gives its link up (what it
    # queued is lost with it) and keeps computing windows meanwhile
    await eventually(lambda: a.persister._reregister_due, timeout=5, what="the registry given up")
    a.hold([h(2)])
    s.registry = await s.start_again("swa")
    await eventually(lambda: s.registry.registry.lookup([h(1), h(2)]) == [a.config.advertise] * 2, timeout=5,
                     what="every window registered with the returned registry")


SLOW = {"heartbeat_s": 0.1, "dead_after": 20}   # a check-in may wait 2 s for its answer


class SlowRegistry(SwaRegistryService):
    """A registry behind a slow network (or on a loaded host): every answer takes two heartbeat
    intervals, well within dead_after_s."""

    async def on_register(self, msg, ctx):
        await asyncio.sleep(2 * SLOW["heartbeat_s"])   # the injected latency, not a wait for a condition
        return await super().on_register(msg, ctx)


async def test_a_registry_slower_than_a_heartbeat_interval_still_learns_and_relearns_the_workers_windows(tmp_path):
    # a check-in given up on after one interval would never be answered in time: the worker would
    # stay unregistered for good (its late answers are refused as unexpected)
    s = RestartableServices(tmp_path, SLOW)
    try:
        s.registry = await s.start(SlowRegistry, "swa")
        a = await s.start(TestHelperWindowHolder, "a", {"swa_registry": s.registry.config.advertise})
        a.hold([h(1), h(2)])
        await eventually(lambda: s.registry.registry.lookup([h(1), h(2)]) == [a.config.advertise] * 2,
                         timeout=10, what="registered through a slow registry")
        old = s.registry.incarnation
        s.registry = await s.restart(s.registry)
        await eventually(lambda: s.registry.registry.lookup([h(1), h(2)]) == [a.config.advertise] * 2,
                         timeout=10, what="registered again with the restarted slow registry")
        assert a.persister.registry_incarnation == s.registry.incarnation != old
    finally:
        await s.close()
