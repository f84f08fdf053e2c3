"""SwaRegistryService over real ZeroMQ: one-way register / unregister (acknowledged only when asked),
lookup, SwaFetch forwarded to the holder (which answers the requester directly), typed errors,
background expiry, dead holders, metrics and a clean stop."""
from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

import pytest

from messages.control import Register, ServiceState, StatusQuery
from messages.errors import ErrorCode, RemoteError, RequestTimeout
from messages.handoff import SwaFetch, SwaState
from messages.swa_registry import SwaAck, SwaLookup, SwaLookupReply, SwaRegister, SwaUnregister
from services.runtime.config import ServiceConfig
from services.runtime.service import Service
from services.swa_registry.service import SwaRegistryService
from tests.helpers.test_helper_async import eventually

W1, W2 = "tcp://worker-1:6000", "tcp://worker-2:6000"


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


class TestHelperSwaHolder(Service):
    """Test-only: a worker holding window states. A forwarded SwaFetch is answered with SwaState sent
    straight to the requester, as the reply to the requester's own call."""

    kind = "prefill_worker"
    __test__ = False

    def __init__(self, config):
        super().__init__(config)
        self.fetches: list[tuple[str, SwaFetch]] = []

    def handlers(self):
        return {SwaFetch: self._on_fetch}

    async def _on_fetch(self, msg: SwaFetch, ctx) -> None:
        self.fetches.append((ctx.request_id, msg))
        state = SwaState(True, num_tokens=128 * len(self.fetches), prefix_hash=msg.prefix_hashes[0])
        self.send(msg.reply_to, state, request_id=ctx.request_id, in_reply_to=msg.reply_msg_id)


async def fetch(client: Service, address: str, hashes: list[bytes], request_id: str = ""):
    """The requester's side: one call to the registry, answered by whoever serves the state."""
    return await client.call(address, SwaFetch(hashes, client.config.advertise), request_id=request_id, timeout=5.0)


@asynccontextmanager
async def holders(tmp_path, *names: str):
    started = [TestHelperSwaHolder(ServiceConfig(kind="prefill_worker", instance=name,
                                                 bind=f"ipc://{tmp_path}/{name}.sock")) for name in names]
    tasks = [asyncio.create_task(holder.run(install_signals=False)) for holder in started]
    try:
        await eventually(lambda: all(holder.state == ServiceState.RUNNING for holder in started), what="holders up")
        yield started
    finally:
        for holder in started:
            holder.stop()
        assert await asyncio.gather(*tasks) == [0] * len(started)


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


def sample_sent(registry: SwaRegistryService, type_name: str) -> float | None:
    return registry.metrics.registry.get_sample_value(
        "epd_messages_out_total", {"kind": "swa_registry", "instance": "r", "type": type_name})


async def test_register_lookup_unregister_round_trip(tmp_path):
    async with running(tmp_path) as (registry, client, address):
        ack = (await client.call(address, SwaRegister([h(1), h(2)], W1, 180.0, ack=True))).message
        assert ack == SwaAck(2, registry.incarnation)
        reply = (await client.call(address, SwaLookup([h(2), h(3), h(1)]))).message
        assert reply == SwaLookupReply([W1, "", W1])
        for holder, removed in ((W2, 0), (W1, 1)):
            reply = (await client.call(address, SwaUnregister([h(1)], holder, ack=True))).message
            assert reply == SwaAck(removed, registry.incarnation)
        reply = (await client.call(address, SwaLookup([h(1), h(2)]))).message
        assert reply.holders == ["", W1]


async def test_register_and_unregister_are_one_way_unless_an_ack_is_asked(tmp_path):
    async with running(tmp_path) as (registry, client, address):
        client.send(address, SwaRegister([h(1), h(2)], W1))
        await eventually(lambda: len(registry.registry) == 2, what="registered")
        with pytest.raises(RequestTimeout):                  # nothing comes back
            await client.call(address, SwaRegister([h(3)], W1), timeout=0.2)
        assert len(registry.registry) == 3
        client.send(address, SwaUnregister([h(1)], W1))
        await eventually(lambda: len(registry.registry) == 2, what="unregistered")
        with pytest.raises(RequestTimeout):
            await client.call(address, SwaUnregister([h(2)], W1), timeout=0.2)
        assert (await client.call(address, SwaLookup([h(1), h(2), h(3)]))).message.holders == ["", "", W1]
        assert sample_sent(registry, "SwaAck") is None       # not one acknowledgement was sent
        reply = (await client.call(address, SwaRegister([h(4)], W2, ack=True))).message
        assert reply == SwaAck(1, registry.incarnation)
        assert sample_sent(registry, "SwaAck") == 1


async def test_latest_holder_wins(tmp_path):
    async with running(tmp_path) as (registry, client, address):
        await client.call(address, SwaRegister([h(1)], W1, ack=True))
        await client.call(address, SwaRegister([h(1)], W2, ack=True))
        assert (await client.call(address, SwaLookup([h(1)]))).message.holders == [W2]


async def test_a_fetch_is_answered_by_the_holder_as_the_reply_to_the_requesters_call(tmp_path):
    async with running(tmp_path) as (registry, client, address), holders(tmp_path, "ha", "hb") as (a, b):
        await client.call(address, SwaRegister([h(4)], a.config.advertise, ack=True))
        await client.call(address, SwaRegister([h(3), h(2)], b.config.advertise, ack=True))
        reply = await fetch(client, address, [h(5), h(4), h(3), h(2)], request_id="req-1")   # best first
        assert reply.header.sender == "ha"                     # straight from the holder
        assert reply.message == SwaState(True, num_tokens=128, prefix_hash=h(4))
        assert reply.header.request_id == "req-1"
        [(rid, forwarded)] = a.fetches
        assert rid == "req-1" and forwarded.prefix_hashes == [h(4)]   # only the hashes it holds
        assert forwarded.reply_to == client.config.advertise and forwarded.reply_msg_id
        assert b.fetches == []


async def test_a_fetch_forwards_every_asked_hash_the_chosen_holder_holds(tmp_path):
    async with running(tmp_path) as (registry, client, address), holders(tmp_path, "ha", "hb") as (a, b):
        await client.call(address, SwaRegister([h(2), h(4)], a.config.advertise, ack=True))
        await client.call(address, SwaRegister([h(3)], b.config.advertise, ack=True))
        reply = await fetch(client, address, [h(4), h(3), h(2)])
        assert reply.message.prefix_hash == h(4)
        assert [f.prefix_hashes for _, f in a.fetches] == [[h(4), h(2)]] and b.fetches == []
        # a later fetch goes to the holder of its own best hash
        reply = await fetch(client, address, [h(3)])
        assert (reply.header.sender, reply.message.prefix_hash) == ("hb", h(3))


async def test_the_requester_is_never_chosen_as_the_holder(tmp_path):
    async with running(tmp_path) as (registry, client, address), holders(tmp_path, "ha") as (a,):
        me = client.config.advertise
        await client.call(address, SwaRegister([h(4)], me, ack=True))
        await client.call(address, SwaRegister([h(3)], a.config.advertise, ack=True))
        reply = await fetch(client, address, [h(4), h(3)])
        assert reply.header.sender == "ha" and [f.prefix_hashes for _, f in a.fetches] == [[h(3)]]
        reply = await fetch(client, address, [h(4)])    # only the requester holds it
        assert (reply.header.sender, reply.message) == ("r", SwaState(found=False))
        assert len(a.fetches) == 1


async def test_a_fetch_nobody_can_serve_is_answered_not_found_by_the_registry(tmp_path):
    async with running(tmp_path) as (registry, client, address), holders(tmp_path, "ha") as (a,):
        await client.call(address, SwaRegister([h(1)], a.config.advertise, ack=True))
        reply = await fetch(client, address, [h(7), h(8)], request_id="req-2")
        assert (reply.header.sender, reply.message) == ("r", SwaState(found=False))
        assert reply.header.request_id == "req-2" and a.fetches == []


async def test_a_fetch_without_reply_to_is_an_invalid_request(tmp_path):
    async with running(tmp_path) as (registry, client, address), holders(tmp_path, "ha") as (a,):
        await client.call(address, SwaRegister([h(1)], a.config.advertise, ack=True))
        with pytest.raises(RemoteError) as err:
            await client.call(address, SwaFetch([h(1)]))
        assert err.value.code == ErrorCode.INVALID_REQUEST and "reply_to" in err.value.message
        assert a.fetches == []


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
    SwaFetch([h(1)]),
    SwaFetch([h(i) for i in range(9)], "tcp://requester:1"),
    SwaFetch([b""], "tcp://requester:1"),
], ids=["empty-hash", "long-hash", "zero-ttl", "negative-ttl", "nan-ttl", "empty-holder",
        "too-many-register", "too-many-lookup", "long-hash-unregister", "fetch-without-reply-to",
        "too-many-fetch", "empty-hash-fetch"])
async def test_invalid_requests_get_a_typed_error_and_the_service_keeps_serving(tmp_path, bad):
    async with running(tmp_path, {"max_hashes_per_message": 8}) as (registry, client, address):
        with pytest.raises(RemoteError) as err:
            await client.call(address, bad)
        assert err.value.code == ErrorCode.INVALID_REQUEST
        assert len(registry.registry) == 0
        reply = (await client.call(address, SwaRegister([h(1)], W1, ack=True))).message
        assert reply == SwaAck(1, registry.incarnation)


async def test_background_task_expires_entries(tmp_path):
    settings = {"expire_interval_s": 0.02, "expire_batch": 2}
    async with running(tmp_path, settings) as (registry, client, address):
        await client.call(address, SwaRegister([h(i) for i in range(5)], W1, 0.05, ack=True))
        await client.call(address, SwaRegister([h(9)], W2, 60.0, ack=True))
        await eventually(lambda: len(registry.registry) == 1, what="expiry")
        assert sample(registry, "epd_swa_expirations_total") == 5
        assert sample(registry, "epd_swa_entries") == 1
        assert (await client.call(address, SwaLookup([h(0), h(9)]))).message.holders == ["", W2]


async def test_a_dead_peer_loses_its_entries(tmp_path):
    async with running(tmp_path, heartbeat_s=0.05, dead_after=2) as (registry, client, address):
        await client.call(address, Register(kind="decode_worker", instance="w1", address=W1))
        await client.call(address, SwaRegister([h(1), h(2)], W1, ack=True))
        await client.call(address, SwaRegister([h(3)], W2, ack=True))
        # w1 never heartbeats: the registry declares it dead and drops what it held
        await eventually(lambda: len(registry.registry) == 1, what="dead holder dropped")
        reply = (await client.call(address, SwaLookup([h(1), h(2), h(3)]))).message
        assert reply.holders == ["", "", W2]
        assert sample(registry, "epd_swa_dropped_total") == 2


async def test_metrics_count_registrations_lookups_hits_misses_and_evictions(tmp_path):
    async with running(tmp_path, {"max_entries": 2}) as (registry, client, address):
        await client.call(address, SwaRegister([h(1)], W1, 10.0, ack=True))
        await client.call(address, SwaRegister([h(2), h(3)], W1, 100.0, ack=True))   # h(1) is evicted
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


@pytest.mark.parametrize("settings, named", [
    ({"ttl": 5}, "ttl"),
    ({"limits": {}}, "limits"),                           # the limits are given flat
    ({"max_entries": 0}, "max_entries"),
    ({"max_ttl_s": "long"}, "max_ttl_s"),
    ({"expire_interval_s": 0}, "expire_interval_s"),
    ({"expire_batch": 0}, "expire_batch"),
])
def test_unknown_or_invalid_settings_are_refused_naming_the_key(tmp_path, settings, named):
    with pytest.raises(ValueError) as err:
        SwaRegistryService(ServiceConfig(kind="swa_registry", instance="r",
                                         bind=f"ipc://{tmp_path}/r.sock", settings=settings))
    assert "swa_registry" in str(err.value) and named in str(err.value)


def test_flat_limits_reach_the_registry(tmp_path):
    service = SwaRegistryService(ServiceConfig(kind="swa_registry", instance="r", bind=f"ipc://{tmp_path}/r.sock",
                                               settings={"max_entries": 7, "max_ttl_s": 300}))
    assert (service.settings.limits.max_entries, service.settings.limits.max_ttl_s) == (7, 300.0)
