"""The gateway's block hashes carry the model identity the workers announced, learned through its
upstream and never configured: a worker serving released weights (`+released` in its identity) gets
prompts hashed under that identity. Before any worker registered, a prompt of a block or more is
refused with a retryable 503 `model_unknown` (Anthropic's 529) and nothing goes upstream."""
from __future__ import annotations

import aiohttp
import pytest

from messages.prefix import BLOCK_TOKENS, block_hashes
from services.gateway.service import GatewayService
from tests.gateway.conftest import MODEL
from tests.helpers.test_helper_async import eventually
from tests.helpers.test_helper_services import InProcessServices
from tests.helpers.test_helper_stack import free_port_base
from tests.helpers.test_helper_streaming_worker import TestHelperRouter, TestHelperStreamingWorker

RELEASED = "deepseek-v4-tiny-float32+released-0123456789abcdef"
LONG = "several blocks of prompt " * 120   # well over one 128-token block
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": LONG}], "max_tokens": 2,
        "thinking": {"type": "disabled"}}
MESSAGES = {"model": MODEL, "messages": [{"role": "user", "content": LONG}], "max_tokens": 2}


class TestHelperReleasedWorker(TestHelperStreamingWorker):
    """A streaming worker that announces a released-weights identity when it registers."""

    model_id = RELEASED
    __test__ = False


@pytest.fixture
async def stack(tmp_path):
    services = InProcessServices(tmp_path)
    port = free_port_base(1, offset=0)
    worker_address = f"ipc://{tmp_path}/worker.sock"
    router = await services.start(TestHelperRouter, "router", {"worker": worker_address})
    gateway = await services.start(GatewayService, "gw", {"http_bind": f"127.0.0.1:{port}", "context_length": 8192},
                                   router.config.advertise)
    await eventually(lambda: gateway.upstream.connected, what="the gateway registered with the router")
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
            yield services, router, gateway, http
    finally:
        await services.close()


async def test_before_any_worker_registered_a_long_prompt_is_a_retryable_overload(stack):
    services, router, gateway, http = stack
    async with http.post("/v1/chat/completions", json=CHAT) as r:
        body = await r.json()
        assert r.status == 503 and r.headers["Retry-After"].isdigit() and body["error"]["code"] == "model_unknown"
        assert "no worker has registered yet" in body["error"]["message"]
    async with http.post("/v1/messages", json=MESSAGES) as r:
        assert r.status == 529 and (await r.json())["error"]["type"] == "overloaded_error"
    assert gateway.model_id == "" and b"GenerateRequest" not in gateway.metrics.exposition()


async def test_prompts_are_hashed_under_the_identity_the_registered_worker_announced(stack, tmp_path):
    services, router, gateway, http = stack
    worker = await services.start(TestHelperReleasedWorker, "worker", {"chunks": 1}, router.config.advertise)
    await eventually(lambda: gateway.model_id == RELEASED, what="the gateway to learn the worker's identity")
    async with http.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "req-released"}) as r:
        assert r.status == 200, await r.text()
    assert b"GenerateRequest" in gateway.metrics.exposition()   # what the first test shows absent
    sent = worker.received["req-released"]
    assert len(sent.prompt_ids) >= 2 * BLOCK_TOKENS
    assert sent.block_hashes == block_hashes(RELEASED, sent.prompt_ids) != block_hashes("", sent.prompt_ids)
