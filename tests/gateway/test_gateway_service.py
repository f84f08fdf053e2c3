"""The gateway service in-process with an upstream that never answers: authentication,
overload (429 / 529), and a typed timeout instead of a hang; nothing is left pending."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest

from services.gateway.service import GatewayService
from services.runtime.config import ServiceConfig
from tests.gateway.conftest import MODEL
from tests.helpers.test_helper_stack import free_port_base

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
MESSAGES = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


@pytest.fixture
async def gateway(tmp_path, tiny_model_dir):
    port = free_port_base(1, offset=0)
    svc = GatewayService(ServiceConfig(
        kind="gateway", instance="gw", bind=f"ipc://{tmp_path}/gw.sock", upstream=f"ipc://{tmp_path}/nobody.sock",
        settings={"http_bind": f"127.0.0.1:{port}", "model_dir": str(tiny_model_dir), "context_length": 4096,
                  "api_keys": ["sekrit"], "max_concurrent_requests": 1, "first_chunk_timeout_s": 1.0}))
    task = asyncio.create_task(svc.run(install_signals=False))
    while svc.state == 0 and not task.done():
        await asyncio.sleep(0.01)
    async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
        yield svc, session
    svc.stop()
    assert await task == 0


async def test_api_keys_are_checked_in_both_header_styles(gateway):
    svc, http = gateway
    async with http.post("/v1/chat/completions", json=CHAT) as r:
        assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
    async with http.post("/v1/messages", json=MESSAGES, headers={"x-api-key": "wrong"}) as r:
        body = await r.json()
        assert r.status == 401 and body == {"type": "error", "error": {
            "type": "authentication_error", "message": "invalid or missing API key"}}
    async with http.get("/v1/models", headers={"Authorization": "Bearer sekrit"}) as r:
        assert r.status == 200 and (await r.json())["data"][0]["id"] == MODEL


async def test_silent_upstream_gives_a_timeout_and_overload_is_429_or_529(gateway):
    svc, http = gateway
    auth = {"Authorization": "Bearer sekrit"}

    async def first():
        async with http.post("/v1/chat/completions", json=CHAT, headers=auth) as r:
            return r.status, await r.json()

    slow = asyncio.create_task(first())
    while not svc.pending:   # the first request is admitted and waits for the (silent) upstream
        await asyncio.sleep(0.01)
    async with http.post("/v1/chat/completions", json=CHAT, headers=auth) as r:
        assert r.status == 429 and (await r.json())["error"]["type"] == "rate_limit_error"
    async with http.post("/v1/messages", json=MESSAGES, headers={"x-api-key": "sekrit"}) as r:
        assert r.status == 529 and (await r.json())["error"]["type"] == "overloaded_error"
    status, body = await slow
    assert status == 504 and body["error"]["code"] == "timeout"
    assert svc.pending == {}


IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
WITH_IMAGES = [
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [IMAGE]}]}),
    ("/v1/responses", {"model": MODEL, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://example.com/cat.png"}]}]}),
    ("/v1/messages", {**MESSAGES, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}]}]}),
]
CONSTRAINED = [
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}}),
    ("/v1/responses", {"model": MODEL, "input": "Answer in json.", "text": {"format": {"type": "json_object"}}}),
    ("/v1/messages", {**MESSAGES, "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                      "tool_choice": {"type": "any"}}),
]


def nothing_went_upstream(svc) -> bool:
    return svc.pending == {} and b"GenerateRequest" not in svc.metrics.exposition()


async def test_images_are_a_400_over_http_and_never_reach_the_upstream(gateway):
    svc, http = gateway
    for path, body in WITH_IMAGES:   # one gateway for all three (each start takes ~1.5 s)
        async with http.post(path, json=body, headers={"x-api-key": "sekrit"}) as r:
            payload = await r.json()
        assert r.status == 400, path
        assert "image inputs are not supported" in payload["error"]["message"]
        assert (payload.get("type") == "error") == (path == "/v1/messages")   # each protocol's shape
    assert nothing_went_upstream(svc)


async def test_constrained_requests_without_a_grammar_compiler_are_a_retryable_503(gateway):
    """No compiler registered: the constraint could not be enforced, so the request is refused before
    it is sent, as a retryable overload (503; Anthropic's overload is 529) in the protocol's shape."""
    svc, http = gateway
    for path, body in CONSTRAINED:
        async with http.post(path, json=body, headers={"x-api-key": "sekrit"}) as r:
            payload = await r.json()
        anthropic = path == "/v1/messages"
        assert r.status == (529 if anthropic else 503) and r.headers["Retry-After"].isdigit(), path
        assert "grammar compiler" in payload["error"]["message"]
        if anthropic:
            assert payload == {"type": "error", "error": {"type": "overloaded_error",
                                                          "message": payload["error"]["message"]}}
        else:
            assert payload["error"]["code"] == "grammar_compiler_unavailable"
    assert nothing_went_upstream(svc)
