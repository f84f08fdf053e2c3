"""DecodeRouterService over real ZeroMQ: decode workers register and heartbeat their load; a
DecodeTableQuery is answered with DecodeTable: every alive decode worker with its last load, its
state and its heartbeat's age, and the score's weights from the settings. Draining workers are
listed as DRAINING, dead ones disappear, other kinds never appear; bad settings are refused."""
from __future__ import annotations

import asyncio

import pytest

from messages.control import Load, ServiceState
from messages.generate import AbortRequest
from messages.routing import DecodeTable, DecodeTableQuery
from services.catalog import resolve
from services.decode_router.service import DecodeRouterService
from services.runtime.config import ServiceConfig
from services.runtime.service import Service
from tests.helpers.test_helper_async import eventually

# A dead peer is noticed after 1 s. At 0.05 s x 3, a 0.15 s stall of a loaded machine's event loop (two
# test processes and stacks on 2 cores) read as a dead decode worker and dropped its reservations.
FAST = {"heartbeat_s": 0.05, "dead_after": 20}


class TestHelperDecodeWorker(Service):
    """Test-only: a decode worker that reports a settable load and records the aborts it gets."""

    kind = "decode_worker"
    __test__ = False

    def __init__(self, config, load: Load | None = None):
        super().__init__(config)
        self.fixed_load = load or Load()
        self.aborted: list[str] = []
        self.busy = False

    def handlers(self):
        return {AbortRequest: self._on_abort}

    async def _on_abort(self, msg: AbortRequest, ctx) -> None:
        self.aborted.append(ctx.request_id)

    def in_flight(self) -> int:
        return super().in_flight() + int(self.busy)

    def load(self) -> Load:
        return self.fixed_load


class Running:
    """Services started in this test, stopped (and checked to exit cleanly) at the end."""

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.tasks: list[tuple[Service, asyncio.Task]] = []

    async def start(self, cls, name: str, *, settings=None, upstream: str = "", **kwargs) -> Service:
        config = ServiceConfig(kind=cls.kind, instance=name, bind=f"ipc://{self.tmp_path}/{name}.sock",
                               upstream=upstream, settings=settings or {}, **FAST)
        svc = cls(config, **kwargs)
        task = asyncio.create_task(svc.run(install_signals=False))
        self.tasks.append((svc, task))
        await eventually(lambda: svc.state != ServiceState.STARTING or task.done(), what=f"{name} started")
        assert not task.done(), f"{name} failed to start"
        return svc

    async def stop(self, svc: Service) -> None:
        for s, task in self.tasks:
            if s is svc:
                svc.stop()
                assert await task == 0

    async def close(self) -> None:
        for svc, task in reversed(self.tasks):
            svc.stop()
        codes = await asyncio.gather(*(task for _, task in self.tasks))
        assert all(code == 0 for code in codes)


@pytest.fixture
async def running(tmp_path):
    services = Running(tmp_path)
    yield services
    await services.close()


async def start_router(running: Running, *workers: tuple[str, Load], settings=None):
    router = await running.start(DecodeRouterService, "decode-router", settings=settings)
    client = await running.start(Service, "client")
    started = [await running.start(TestHelperDecodeWorker, name, upstream=router.config.advertise, load=load)
               for name, load in workers]
    await eventually(lambda: len(router.members.alive("decode_worker")) == len(workers) and
                     all(p.last_seen > 0 and p.load == load for p, (_, load) in
                         zip(sorted(router.members.alive("decode_worker"), key=lambda p: p.instance), workers)),
                     what="workers registered with their load")
    return router, client, started


async def table_of(client: Service, router: DecodeRouterService) -> DecodeTable:
    reply = (await client.call(router.config.advertise, DecodeTableQuery())).message
    assert isinstance(reply, DecodeTable)
    return reply


def by_name(table: DecodeTable) -> dict:
    return {w.instance: w for w in table.workers}


async def test_the_table_lists_each_registered_worker_with_its_load_and_state(running):
    a_load, b_load = Load(batch_size=8, kv_usage=0.7, capacity=32), Load(batch_size=16, kv_usage=0.1)
    router, client, (a, b) = await start_router(running, ("d-a", a_load), ("d-b", b_load))
    table = await table_of(client, router)
    workers = by_name(table)
    assert sorted(workers) == ["d-a", "d-b"]
    for worker, load in ((a, a_load), (b, b_load)):
        status = workers[worker.config.instance]
        assert (status.address, status.kind, status.load) == (worker.config.advertise, "decode_worker", load)
        assert status.alive and status.state == ServiceState.RUNNING
        assert 0.0 <= status.last_heartbeat_age_s < 1.0        # seconds since it was heard, not a timestamp
    assert (table.alpha, table.beta) == (1.0, 1.0)
    labels = {"kind": "decode_router", "instance": "decode-router"}
    assert router.metrics.registry.get_sample_value("epd_decode_router_tables_total", labels) == 1


async def test_the_table_follows_load_changes(running):
    router, client, (a,) = await start_router(running, ("d-a", Load(batch_size=1)))
    a.fixed_load = Load(batch_size=5, kv_usage=0.5, capacity=8)
    await eventually(lambda: router.members.get("d-a").load == a.fixed_load, what="new load heard")
    assert by_name(await table_of(client, router))["d-a"].load == Load(batch_size=5, kv_usage=0.5, capacity=8)


async def test_no_decode_worker_is_an_empty_table_not_an_error(running):
    router, client, _ = await start_router(running)
    assert (await table_of(client, router)).workers == []


async def test_only_the_decode_worker_kind_is_listed(running):
    router, client, (a,) = await start_router(running, ("d-a", Load()))
    await running.start(Service, "not-a-decoder", upstream=router.config.advertise)   # kind "echo"
    await eventually(lambda: len(router.members.alive()) == 2, what="other kind registered")
    assert list(by_name(await table_of(client, router))) == ["d-a"]


async def test_the_worker_kind_comes_from_the_settings(running):
    router, client, _ = await start_router(running, settings={"worker_kind": "echo"})
    await running.start(Service, "echo-worker", upstream=router.config.advertise)
    await running.start(TestHelperDecodeWorker, "d-a", upstream=router.config.advertise)
    await eventually(lambda: len(router.members.alive()) == 2, what="both registered")
    assert list(by_name(await table_of(client, router))) == ["echo-worker"]


async def test_draining_workers_are_listed_as_draining_and_dead_ones_disappear(running):
    router, client, (a, b, c) = await start_router(
        running, ("d-a", Load()), ("d-b", Load(kv_usage=0.5)), ("d-c", Load(kv_usage=0.9)))
    a.busy = True
    a.begin_drain(grace_s=30.0)
    await eventually(lambda: router.members.get("d-a").state == ServiceState.DRAINING, what="d-a draining")
    await running.stop(b)
    await eventually(lambda: not router.members.get("d-b").alive, what="d-b declared dead")
    workers = by_name(await table_of(client, router))
    assert sorted(workers) == ["d-a", "d-c"]
    assert workers["d-a"].state == ServiceState.DRAINING and workers["d-c"].state == ServiceState.RUNNING
    await running.stop(c)
    await eventually(lambda: not router.members.get("d-c").alive, what="d-c declared dead")
    assert list(by_name(await table_of(client, router))) == ["d-a"]
    a.busy = False


async def test_alpha_and_beta_come_from_the_settings(running):
    router, client, _ = await start_router(running, settings={"alpha": 0.25, "beta": 3})
    table = await table_of(client, router)
    assert (table.alpha, table.beta) == (0.25, 3.0)


def test_the_catalog_knows_the_kind():
    assert resolve("decode_router") is DecodeRouterService


@pytest.mark.parametrize("settings, named", [
    ({"gamma": 1.0}, "gamma"),
    ({"pick_hold_s": 1.0}, "pick_hold_s"),          # retired with DecodePick
    ({"alpha": -1.0}, "alpha"),
    ({"beta": float("nan")}, "beta"),
    ({"alpha": "high"}, "alpha"),
    ({"worker_kind": ""}, "worker_kind"),
])
def test_bad_settings_are_refused_naming_the_service_and_the_key(tmp_path, settings, named):
    with pytest.raises(ValueError) as err:
        DecodeRouterService(ServiceConfig(kind="decode_router", instance="r",
                                          bind=f"ipc://{tmp_path}/r.sock", settings=settings))
    assert "decode_router" in str(err.value) and named in str(err.value)
