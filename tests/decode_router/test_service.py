"""DecodeRouterService over real ZeroMQ: decode workers register and heartbeat their load, DecodePick
answers with the lowest-scoring live worker, draining and dead workers are skipped, none -> OVERLOADED."""
from __future__ import annotations

import asyncio
import time

import pytest

from messages.control import Load, ServiceState
from messages.errors import ErrorCode, RemoteError
from messages.generate import AbortRequest
from messages.routing import DecodeChoice, DecodePick
from services.catalog import resolve
from services.decode_router.service import DecodeRouterService
from services.runtime.config import ServiceConfig
from services.runtime.service import Service
from tests.helpers.test_helper_async import eventually

FAST = {"heartbeat_s": 0.05, "dead_after": 3}


class TestHelperDecodeWorker(Service):
    """Test-only: a decode worker that reports a fixed load and records the aborts it gets."""

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


async def start_router(running: Running, *workers: tuple[str, Load]):
    router = await running.start(DecodeRouterService, "decode-router")
    client = await running.start(Service, "client")
    started = [await running.start(TestHelperDecodeWorker, name, upstream=router.config.advertise, load=load)
               for name, load in workers]
    await eventually(lambda: len(router.members.alive("decode_worker")) == len(workers) and
                     all(p.last_seen > 0 and p.load == load for p, (_, load) in
                         zip(sorted(router.members.alive("decode_worker"), key=lambda p: p.instance), workers)),
                     what="workers registered with their load")
    return router, client, started


async def test_decode_pick_answers_with_the_lowest_scoring_worker(running):
    router, client, (a, b) = await start_router(
        running, ("d-a", Load(batch_size=8, kv_usage=0.7)), ("d-b", Load(batch_size=16, kv_usage=0.1)))
    reply = (await client.call(router.config.advertise, DecodePick(prompt_tokens=900, max_tokens=64),
                               request_id="r1")).message
    # normalised by the larger batch (16): a = 0.7 + 0.5 = 1.2, b = 0.1 + 1.0 = 1.1
    assert reply == DecodeChoice("d-b", b.config.advertise)


async def test_recent_picks_spread_a_burst(running):
    router, client, _ = await start_router(running, ("d-a", Load()), ("d-b", Load()))
    picks = [(await client.call(router.config.advertise, DecodePick(), request_id=f"r{i}")).message.instance
             for i in range(4)]
    assert picks == ["d-a", "d-b", "d-a", "d-b"]


async def test_no_decode_worker_alive_is_overloaded(running):
    router, client, _ = await start_router(running)
    with pytest.raises(RemoteError) as err:
        await client.call(router.config.advertise, DecodePick(), request_id="r1")
    assert err.value.code == ErrorCode.OVERLOADED


async def test_draining_and_dead_workers_are_skipped(running):
    router, client, (a, b, c) = await start_router(
        running, ("d-a", Load()), ("d-b", Load(kv_usage=0.5)), ("d-c", Load(kv_usage=0.9)))
    a.busy = True
    a.begin_drain(grace_s=30.0)
    await eventually(lambda: router.members.get("d-a").state == ServiceState.DRAINING, what="d-a draining")
    await running.stop(b)
    await eventually(lambda: not router.members.get("d-b").alive, what="d-b declared dead")
    reply = (await client.call(router.config.advertise, DecodePick(), request_id="r1")).message
    assert reply.instance == "d-c"
    await running.stop(c)
    await eventually(lambda: not router.members.get("d-c").alive, what="d-c declared dead")
    with pytest.raises(RemoteError) as err:
        await client.call(router.config.advertise, DecodePick(), request_id="r2")
    assert err.value.code == ErrorCode.OVERLOADED
    a.busy = False


def test_the_catalog_knows_the_kind_and_bad_settings_are_refused(tmp_path):
    assert resolve("decode_router") is DecodeRouterService
    for settings in ({"gamma": 1.0}, {"alpha": -1.0}, {"worker_kind": ""}):
        with pytest.raises(ValueError):
            DecodeRouterService(ServiceConfig(kind="decode_router", instance="r",
                                              bind=f"ipc://{tmp_path}/r.sock", settings=settings))
