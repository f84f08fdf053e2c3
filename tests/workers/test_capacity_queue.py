"""When no worker has room a request waits in the prefill router's queue; only a full queue or a
passed deadline refuses it, as 429 (OpenAI APIs) or 529 (Anthropic) at the gateway, in-process."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest

from services.gateway.service import GatewayService
from services.prefill_router.service import PrefillRouterService
from services.runtime.config import ServiceConfig
from tests.gateway.conftest import MODEL
from tests.helpers.test_helper_async import eventually
from tests.helpers.test_helper_stack import free_port_base

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
FAST = {"heartbeat_s": 0.1, "dead_after": 5}


@pytest.fixture
async def gateway_and_router(tmp_path, tiny_model_dir):
    """A gateway whose prefill router has no prefill rank yet (nothing can take work) and waits
    at most 0.5 s, with room for 2 waiting requests per bucket."""
    router = PrefillRouterService(ServiceConfig(
        kind="prefill_router", instance="router", bind=f"ipc://{tmp_path}/router.sock",
        settings={"max_queue_wait_s": 0.5, "queue_limit": 2}, **FAST))
    port = free_port_base(1, offset=0)
    gateway = GatewayService(ServiceConfig(
        kind="gateway", instance="gw", bind=f"ipc://{tmp_path}/gw.sock", upstream=router.config.advertise,
        settings={"http_bind": f"127.0.0.1:{port}", "model_dir": str(tiny_model_dir), "context_length": 4096},
        **FAST))
    tasks = [asyncio.create_task(s.run(install_signals=False)) for s in (router, gateway)]
    await eventually(lambda: gateway.state == 1 and router.state == 1, timeout=60, what="started")
    async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
        yield router, session
    for s in (gateway, router):
        s.stop()
    assert await asyncio.gather(*tasks) == [0, 0]


async def test_waiting_past_the_deadline_is_429_for_openai_and_529_for_anthropic(gateway_and_router):
    router, http = gateway_and_router

    async def post(path: str):
        async with http.post(path, json=CHAT) as r:
            assert r.headers["Retry-After"] == "1"   # when to try again, as both APIs' clients read it
            return r.status, await r.json()

    (chat_status, chat), (msg_status, msg) = await asyncio.gather(post("/v1/chat/completions"), post("/v1/messages"))
    assert chat_status == 429 and chat["error"]["type"] == "rate_limit_error", chat
    assert "waited more than 0.5 s" in chat["error"]["message"]
    assert msg_status == 529 and msg["error"]["type"] == "overloaded_error", msg
    assert router.core.stats.expired == 2 and router.core.queued() == 0


async def test_a_full_queue_is_refused_at_once_with_429(gateway_and_router):
    router, http = gateway_and_router
    waiting = [asyncio.create_task(http.post("/v1/chat/completions", json=CHAT)) for _ in range(2)]
    await eventually(lambda: router.core.queued() == 2, what="two requests waiting")
    async with http.post("/v1/chat/completions", json=CHAT) as r:
        body = await r.json()
        assert r.status == 429 and "full" in body["error"]["message"], body
    assert router.core.queued() == 2                        # the refusal took nothing from the queue
    for response in await asyncio.gather(*waiting):
        assert response.status == 429                       # then the deadline passes for those two
        response.release()
