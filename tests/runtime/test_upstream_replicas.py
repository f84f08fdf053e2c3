"""A service registers and heartbeats with every replica of its upstream (ServiceConfig.upstream
and upstream_replicas), each on a link of its own; only the first replica's loss is its upstream lost."""
from __future__ import annotations

import asyncio

from services.runtime.config import ServiceConfig
from services.runtime.service import Service
from tests.helpers.test_helper_async import eventually

FAST = {"heartbeat_s": 0.05, "dead_after": 3}
# A replica's loss is noticed within 3 s, and a link to a live replica never misses that long, even
# on a loaded test machine (with FAST, a 0.15 s stall of the loop reads as a lost upstream).
PATIENT = {"heartbeat_s": 0.1, "dead_after": 30}


class TestHelperLossCountingService(Service):
    """Test-only: counts its on_upstream_lost calls."""

    kind = "test_helper_loss_counting"
    __test__ = False

    def __init__(self, config):
        super().__init__(config)
        self.upstream_losses = 0

    def on_upstream_lost(self) -> None:
        self.upstream_losses += 1


async def _start(cls, tmp_path, name, timing=FAST, **fields):
    svc = cls(ServiceConfig(kind=cls.kind, instance=name, bind=f"ipc://{tmp_path}/{name}.sock", **timing, **fields))
    task = asyncio.create_task(svc.run(install_signals=False))
    await eventually(lambda: svc.state != 0 or task.done(), what=f"{name} started")
    assert not task.done(), f"{name} failed to start"
    return svc, task


async def _stop(svc, task) -> None:
    svc.stop()
    assert await task == 0


def _alive(hub, instance: str) -> bool:
    return any(p.instance == instance for p in hub.members.alive())


async def test_a_member_registers_and_heartbeats_with_every_upstream_replica(tmp_path):
    hubs = [await _start(Service, tmp_path, f"hub{i}") for i in range(3)]
    addresses = [hub.config.advertise for hub, _ in hubs]
    member = await _start(TestHelperLossCountingService, tmp_path, "aide", upstream=addresses[0],
                          upstream_replicas=tuple(addresses[1:]))
    for hub, _ in hubs:
        await eventually(lambda: _alive(hub, "aide"), what=f"aide registered with {hub.config.instance}")
        [registered] = hub.members.alive()
        seen = registered.last_seen
        await eventually(lambda: registered.last_seen > seen, what=f"heartbeats reach {hub.config.instance}")
    await _stop(*member)
    for hub in hubs:
        await _stop(*hub)


async def test_losing_another_replica_is_not_losing_the_upstream(tmp_path):
    first, other = [await _start(Service, tmp_path, f"hub{i}", timing=PATIENT) for i in range(2)]
    member, member_task = await _start(TestHelperLossCountingService, tmp_path, "aide", timing=PATIENT,
                                       upstream=first[0].config.advertise,
                                       upstream_replicas=(other[0].config.advertise,))
    await eventually(lambda: _alive(first[0], "aide") and _alive(other[0], "aide"), timeout=30,
                     what="registered with both")
    await _stop(*other)
    [other_link] = member.upstream.others
    await eventually(lambda: other_link.reconnects >= 1, timeout=30, what="the other replica's link noticed it is gone")
    assert member.upstream.connected and member.upstream_losses == 0 and _alive(first[0], "aide")
    await _stop(*first)
    await eventually(lambda: member.upstream_losses == 1, timeout=30, what="the first replica's loss is the upstream lost")
    await _stop(member, member_task)
