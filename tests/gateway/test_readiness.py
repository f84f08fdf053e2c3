"""/ready (readiness.py): 503 naming each pool behind the gateway that has no live, registered worker,
200 once every one has; /health stays liveness. Real routers and gateway in-process; the workers and
the grammar compiler are stand-ins that only register and heartbeat."""
from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from services.decode_router.service import DecodeRouterService
from services.gateway.service import GatewayService
from services.prefill_router.service import PrefillRouterService
from services.runtime.config import ServiceConfig
from services.runtime.service import Service
from tests.helpers.test_helper_async import eventually
from tests.helpers.test_helper_services import InProcessServices
from tests.helpers.test_helper_stack import free_port_base


class PrefillWorkerStandInForTests(Service):
    kind = "prefill_worker"


class DecodeWorkerStandInForTests(Service):
    kind = "decode_worker"


class GrammarCompilerStandInForTests(Service):
    kind = "grammar_compiler"


@pytest.fixture
async def behind(tmp_path, tiny_model_dir):
    """A gateway in front of a prefill router that depends on a decode router, with no workers yet."""
    services = InProcessServices(tmp_path)
    decode = await services.start(DecodeRouterService, "decode_router")
    prefill = await services.start(PrefillRouterService, "prefill_router",
                                   {"decode_router": decode.config.advertise})
    port = free_port_base(1, offset=0)
    gateway = await services.start(GatewayService, "gateway", {
        "http_bind": f"127.0.0.1:{port}", "model_dir": str(tiny_model_dir), "context_length": 4096,
        "aides": ["grammar_compiler"]}, upstream=prefill.config.advertise)
    # started is not registered: until then /ready names "upstream", not the pools behind it
    await eventually(lambda: gateway.upstream.connected, what="the gateway to register with the prefill router")
    async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
        yield services, http, {"prefill": prefill, "decode": decode, "gateway": gateway}
    await services.close()


async def ready(http) -> tuple[int, dict]:
    async with http.get("/ready") as r:
        return r.status, await r.json()


async def ready_until(http, predicate, what: str, timeout: float = 10.0) -> tuple[int, dict]:
    """Poll /ready (bounded) until its answer satisfies `predicate`."""
    deadline = time.monotonic() + timeout
    while True:
        status, body = await ready(http)
        if predicate(status, body):
            return status, body
        assert time.monotonic() < deadline, f"{what}: still {status} {body}"
        await asyncio.sleep(0.05)


async def test_ready_names_each_pool_without_a_worker_until_all_have_one(behind):
    services, http, at = behind
    status, body = await ready(http)
    assert status == 503 and body["not_ready"] == ["decode", "grammar", "prefill"]
    assert "prefill_router" in body["pools"]["prefill"]
    async with http.get("/health") as r:
        assert r.status == 200   # liveness: the gateway itself is fine
    await services.start(PrefillWorkerStandInForTests, "prefill_worker", upstream=at["prefill"].config.advertise)
    status, body = await ready_until(http, lambda s, b: "prefill" not in b["not_ready"], "the prefill pool")
    assert status == 503 and body["not_ready"] == ["decode", "grammar"]
    await services.start(DecodeWorkerStandInForTests, "decode_worker", upstream=at["decode"].config.advertise)
    await services.start(GrammarCompilerStandInForTests, "grammar", upstream=at["gateway"].config.advertise)
    status, body = await ready_until(http, lambda s, b: s == 200, "every pool")
    assert body == {"status": "ready", "not_ready": [],
                    "pools": {"prefill": "ready", "decode": "ready", "grammar": "ready"}}


async def test_a_pool_whose_last_worker_stops_is_not_ready_again(behind):
    services, http, at = behind
    await services.start(PrefillWorkerStandInForTests, "prefill_worker", upstream=at["prefill"].config.advertise)
    decode_worker = await services.start(DecodeWorkerStandInForTests, "decode_worker",
                                         upstream=at["decode"].config.advertise)
    await services.start(GrammarCompilerStandInForTests, "grammar", upstream=at["gateway"].config.advertise)
    await ready_until(http, lambda s, b: s == 200, "every pool")
    decode_worker.stop()
    status, body = await ready_until(http, lambda s, b: s == 503, "the decode pool gone")
    assert body["not_ready"] == ["decode"]


def test_an_unknown_aide_kind_is_refused(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="aides"):
        GatewayService(ServiceConfig(kind="gateway", bind=f"ipc://{tmp_path}/gw.sock", upstream="ipc://x",
                                     settings={"model_dir": str(tiny_model_dir), "aides": ["vision"]}))
