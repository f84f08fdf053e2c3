"""SwaRegistryService over real ZeroMQ: register / lookup / unregister, typed errors, background
expiry, dead holders, metrics and a clean stop."""
from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

import pytest

from messages.control import Register, ServiceState, StatusQuery
from messages.errors import ErrorCode, RemoteError, RequestTimeout
from messages.swa_registry import SwaAck, SwaLookup, SwaLookupReply, SwaRegister, SwaUnregister
from services.runtime.config import ServiceConfig
from services.runtime.service import Service
from services.swa_registry.service import SwaRegistryService
from tests.helpers.test_helper_async import eventually

W1, W2 = "tcp://worker-1:6000", "tcp://worker-2:6000"


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


@asynccontextmanager
async def running(tmp_path, settings=None, **config):
    registry = SwaRegistryService(ServiceConfig(kind="swa_registry", instance="r", bind=f"ipc://{tmp_path}/r.sock",
                                                settings=settings or {}, **config))
    client = Service(ServiceConfig(kind="echo", instance="c", bind=f"ipc://{tmp_path}/c.sock"))
    tasks = [asyncio.create_task(registry.run(install_signals=False)),
             asyncio.create_task(client.run(install_signals=False))]
    try:
        await eventually(lambda: client.state == ServiceState.RUNNING, what="client running")
        address = registry.config.advertise
        deadline = time.monotonic() + 10.0
        while True:   # ready when the registry answers a StatusQuery as RUNNING
            try:
                reply = (await client.call(address, StatusQuery(), timeout=0.5)).message
                if reply.state == ServiceState.RUNNING:
                    break
            except RequestTimeout:
                pass
            assert time.monotonic() < deadline, "registry never became ready"
            await asyncio.sleep(0.01)
        yield registry, client, address
    finally:
        registry.stop()
        client.stop()
        codes = await asyncio.gather(*tasks)
        assert codes == [0, 0]


def sample(registry: SwaRegistryService, name: str) -> float:
    return registry.metrics.registry.get_sample_value(name, {"kind": "swa_registry", "instance": "r"})


async def test_register_lookup_unregister_round_trip(tmp_path):
    async with running(tmp_path) as (registry, client, address):
        ack = (await client.call(address, SwaRegister([h(1), h(2)], W1, 180.0))).message
        assert ack == SwaAck(2)
        reply = (await client.call(address, SwaLookup([h(2), h(3), h(1)]))).message
        assert reply == SwaLookupReply([W1, "", W1])
        assert (await client.call(address, SwaUnregister([h(1)], W2))).message == SwaAck(0)
        assert (await client.call(address, SwaUnregister([h(1)], W1))).message == SwaAck(1)
        reply = (await client.call(address, SwaLookup([h(1), h(2)]))).message
        assert reply.holders == ["", W1]


async def test_latest_holder_wins(tmp_path):
    async with running(tmp_path) as (registry, client, address):
        await client.call(address, SwaRegister([h(1)], W1))
        await client.call(address, SwaRegister([h(1)], W2))
        assert (await client.call(address, SwaLookup([h(1)]))).message.holders == [W2]


@pytest.mark.parametrize("bad", [
    SwaRegister([b""], W1),
    SwaRegister([bytes(65)], W1),
    SwaRegister([h(1)], W1, 0.0),
    SwaRegister([h(1)], W1, -5.0),
    SwaRegister([h(1)], W1, float("nan")),
    SwaRegister([h(1)], "", 10.0),
    SwaRegister([h(i) for i in range(9)], W1),
    SwaLookup([h(i) for i in range(9)]),
    SwaUnregister([bytes(65)], W1),
], ids=["empty-hash", "long-hash", "zero-ttl", "negative-ttl", "nan-ttl", "empty-holder",
        "too-many-register", "too-many-lookup", "long-hash-unregister"])
async def test_invalid_requests_get_a_typed_error_and_the_service_keeps_serving(tmp_path, bad):
    async with running(tmp_path, {"max_hashes_per_message": 8}) as (registry, client, address):
        with pytest.raises(RemoteError) as err:
            await client.call(address, bad)
        assert err.value.code == ErrorCode.INVALID_REQUEST
        assert len(registry.registry) == 0
        assert (await client.call(address, SwaRegister([h(1)], W1))).message == SwaAck(1)


async def test_background_task_expires_entries(tmp_path):
    settings = {"expire_interval_s": 0.02, "expire_batch": 2}
    async with running(tmp_path, settings) as (registry, client, address):
        await client.call(address, SwaRegister([h(i) for i in range(5)], W1, 0.05))
        await client.call(address, SwaRegister([h(9)], W2, 60.0))
        await eventually(lambda: len(registry.registry) == 1, what="expiry")
        assert sample(registry, "epd_swa_expirations_total") == 5
        assert sample(registry, "epd_swa_entries") == 1
        assert (await client.call(address, SwaLookup([h(0), h(9)]))).message.holders == ["", W2]


async def test_a_dead_peer_loses_its_entries(tmp_path):
    async with running(tmp_path, heartbeat_s=0.05, dead_after=2) as (registry, client, address):
        await client.call(address, Register(kind="decode_worker", instance="w1", address=W1))
        await client.call(address, SwaRegister([h(1), h(2)], W1))
        await client.call(address, SwaRegister([h(3)], W2))
        # w1 never heartbeats: the registry declares it dead and drops what it held
        await eventually(lambda: len(registry.registry) == 1, what="dead holder dropped")
        reply = (await client.call(address, SwaLookup([h(1), h(2), h(3)]))).message
        assert reply.holders == ["", "", W2]
        assert sample(registry, "epd_swa_dropped_total") == 2


async def test_metrics_count_registrations_lookups_hits_misses_and_evictions(tmp_path):
    async with running(tmp_path, {"max_entries": 2}) as (registry, client, address):
        await client.call(address, SwaRegister([h(1)], W1, 10.0))
        await client.call(address, SwaRegister([h(2), h(3)], W1, 100.0))   # h(1) is evicted
        await client.call(address, SwaLookup([h(1), h(2), h(3), h(4)]))
        assert sample(registry, "epd_swa_registrations_total") == 3
        assert sample(registry, "epd_swa_lookups_total") == 4
        assert sample(registry, "epd_swa_hits_total") == 2
        assert sample(registry, "epd_swa_misses_total") == 2
        assert sample(registry, "epd_swa_evictions_total") == 1
        assert sample(registry, "epd_swa_entries") == 2
        status = (await client.call(address, StatusQuery())).message
        assert status.kind == "swa_registry"


async def test_stop_cancels_the_expiry_task(tmp_path):
    async with running(tmp_path) as (registry, client, address):
        expiry = registry._expiry
        assert expiry is not None and not expiry.done()
    assert expiry.cancelled() and registry._expiry is None
    assert registry.state == ServiceState.STOPPED


def test_unknown_or_invalid_settings_are_refused(tmp_path):
    for settings in ({"ttl": 5}, {"max_entries": 0}, {"expire_interval_s": 0}):
        with pytest.raises(ValueError):
            SwaRegistryService(ServiceConfig(kind="swa_registry", instance="r",
                                             bind=f"ipc://{tmp_path}/r.sock", settings=settings))
