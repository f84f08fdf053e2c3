"""The gateway's side of images (services/gateway/image_calls.py, vision/): each API's image parts are
fetched SSRF-safe, checked, sized by V4.1's rule and written into the prompt as spans; the request
goes upstream with the image bytes as frames and the live vision groups named; the prompt's block
hashes name the images. A bad image is a 400 in the caller's shape, naming where it was; no live
vision group is a 503. In-process over real ZeroMQ, with a recording upstream."""
from __future__ import annotations

import asyncio
import base64
import hashlib

import aiohttp
import pytest
from aiohttp import web

from messages.images import VisionSizing, plan_image_grid
from messages.prefix import block_hashes
from services.gateway.image_calls import BALANCER_KIND
from services.gateway.service import GatewayService
from tests.gateway.test_gateway_streams import start
from tests.helpers.test_helper_async import eventually
from tests.helpers.test_helper_image_gateway import TestHelperIdleVisionLeader, TestHelperImageUpstream, png_for_tests
from tests.helpers.test_helper_stack import free_port_base

MODEL = "deepseek-v41-tiny"
SMALL, LARGE = png_for_tests(40, 30), png_for_tests(700, 500, shade=90)
HUGE = png_for_tests(5000, 4500)   # 22.5 MP, a small file: over the test gateway's 20 MP (made here, not on the loop)
IMAGE_TOKEN = 129264
LONG_TEXT = "Describe the picture below in the plainest words you can. " * 12   # the image starts after block 0


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def chat(*parts, text: str = "What is this?", **extra) -> dict:
    return {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "text", "text": text}, *parts]}], **extra}


def chat_image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def responses(url: str) -> dict:
    return {"model": MODEL, "max_output_tokens": 4, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": url}]}]}


def messages(source: dict) -> dict:
    return {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image", "source": source}]}]}


def anthropic_base64(png: bytes) -> dict:
    return {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png).decode()}


@pytest.fixture
async def image_gateway(tmp_path, tiny_v41_model_dir):
    """(gateway, recording upstream, http session, local image server base URL on 127.0.0.2)."""
    started: list = []
    hits: list[str] = []

    async def serve(request: web.Request) -> web.StreamResponse:
        hits.append(request.path)
        if request.path == "/to-loopback":
            raise web.HTTPFound(f"http://127.0.0.1:{request.url.port}/small.png")
        return web.Response(body=SMALL, content_type="image/png")

    app = web.Application()
    app.router.add_get("/{name}", serve)
    runner = web.AppRunner(app)
    await runner.setup()
    image_port = free_port_base(1, offset=0)
    await web.TCPSite(runner, "127.0.0.2", image_port).start()
    upstream = await start(TestHelperImageUpstream, tmp_path, "upstream", started)
    port = free_port_base(1, offset=0)
    # dead_after 30 (3 s of silence): a big image decoded in this loop must not make its peers look dead
    gateway = await start(GatewayService, tmp_path, "gw", started, upstream=upstream.config.advertise, dead_after=30,
                          settings={"http_bind": f"127.0.0.1:{port}", "model_dir": str(tiny_v41_model_dir),
                                    "served_model": MODEL, "context_length": 4096,
                                    "image_allow_networks": ["127.0.0.2/32"], "image_max_pixels": 20_000_000})
    leader = await start(TestHelperIdleVisionLeader, tmp_path, "leader", started, upstream=gateway.config.advertise)
    await eventually(lambda: gateway.upstream.connected and gateway.members.alive(BALANCER_KIND),
                     what="the gateway and the vision leader to register")
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
            yield gateway, upstream, http, f"http://127.0.0.2:{image_port}", leader, hits
    finally:
        for svc, task in reversed(started):
            svc.stop()
            assert await task == 0
        await runner.cleanup()


async def post(http, path: str, body: dict, request_id: str):
    async with http.post(path, json=body, headers={"x-request-id": request_id}) as r:
        return r.status, await r.json() if r.content_type == "application/json" else await r.text()


async def sent(upstream, request_id: str):
    await eventually(lambda: request_id in upstream.requests, what="the request to reach the upstream")
    return upstream.requests[request_id]


async def test_every_api_sends_spans_frames_and_groups(image_gateway):
    gateway, upstream, http, base, leader, _ = image_gateway
    sizing = VisionSizing.from_config({"vision_config": {"max_image_tokens": 256, "min_pixels": 15876}})
    cases = [("/v1/chat/completions", chat(chat_image(data_url(LARGE))), LARGE),
             ("/v1/chat/completions", chat(chat_image(f"{base}/small.png")), SMALL),
             ("/v1/responses", responses(data_url(LARGE)), LARGE),
             ("/v1/messages", messages(anthropic_base64(SMALL)), SMALL),
             ("/v1/messages", messages({"type": "url", "url": f"{base}/small.png"}), SMALL)]
    for i, (path, body, png) in enumerate(cases):
        # the recording upstream never answers: each request waits; its message is what is checked
        task = http.post(path, json=body, headers={"x-request-id": f"r{i}"})
        pending = asyncio.ensure_future(task)
        msg, frames = await sent(upstream, f"r{i}")
        pending.cancel()
        [image] = msg.images
        width, height = (700, 500) if png is LARGE else (40, 30)
        assert (image.width, image.height) == (width, height) and image.grid == plan_image_grid(width, height, sizing)
        assert image.digest == hashlib.sha256(png).digest() and frames == [png] and image.data == b""
        assert msg.prompt_ids[image.start : image.end] == [IMAGE_TOKEN] * image.grid.tokens
        assert IMAGE_TOKEN not in msg.prompt_ids[: image.start] + msg.prompt_ids[image.end :]
        assert msg.vision_groups == [leader.config.advertise]
        assert msg.block_hashes == block_hashes(gateway.model_id, msg.prompt_ids, images=msg.images)
    small = plan_image_grid(40, 30, sizing).tokens
    large = plan_image_grid(700, 500, sizing).tokens
    assert large > small   # a bigger image is a longer prompt


@pytest.mark.parametrize("url, code", [
    ("http://127.0.0.1:9/x.png", "image_url_forbidden"),
    ("http://10.0.0.1/x.png", "image_url_forbidden"),
    ("http://169.254.169.254/latest/meta-data/", "image_url_forbidden"),
    ("http://[::1]/x.png", "image_url_forbidden"),
    ("REDIRECT", "image_url_forbidden"),
    ("CORRUPT", "invalid_image"),
    ("OVERSIZED", "image_too_large"),
])
async def test_bad_images_are_400s_in_each_protocols_shape(image_gateway, url, code):
    gateway, upstream, http, base, _, hits = image_gateway
    url = {"REDIRECT": f"{base}/to-loopback", "CORRUPT": data_url(SMALL[:-40]),
           "OVERSIZED": data_url(HUGE)}.get(url, url)
    for path, body in (("/v1/chat/completions", chat(chat_image(url))), ("/v1/responses", responses(url)),
                       ("/v1/messages", messages({"type": "url", "url": url} if not url.startswith("data:")
                                                 else anthropic_base64(base64.b64decode(url.split(",", 1)[1]))))):
        status, payload = await post(http, path, body, "bad")
        assert status == 400, (path, payload)
        if path == "/v1/messages":
            assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
        else:
            assert payload["error"]["code"] == code, payload
    assert upstream.requests == {} and gateway.pending == {}
    if url.endswith("/to-loopback"):
        assert "/small.png" not in hits   # the redirect's target was never fetched


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://example.com/x.png"])
async def test_other_schemes_are_400s(image_gateway, url):
    _, upstream, http, *_ = image_gateway
    status, payload = await post(http, "/v1/chat/completions", chat(chat_image(url)), "scheme")
    assert status == 400, payload
    assert upstream.requests == {}


async def test_the_same_image_hashes_alike_and_another_does_not(image_gateway):
    _, upstream, http, *_ = image_gateway
    waits = [asyncio.ensure_future(http.post("/v1/chat/completions", json=chat(chat_image(data_url(png)), {"type": "text", "text": LONG_TEXT}, text=LONG_TEXT),
                                             headers={"x-request-id": rid}))
             for rid, png in (("a", SMALL), ("b", SMALL), ("c", png_for_tests(40, 30, shade=200)))]
    (a, _), (b, _), (c, _) = [await sent(upstream, rid) for rid in "abc"]
    assert 128 < a.images[0].start < 128 * len(a.block_hashes), (a.images[0].start, len(a.prompt_ids))
    for w in waits:
        w.cancel()
    assert a.prompt_ids == b.prompt_ids == c.prompt_ids   # same size: the same tokens
    assert a.block_hashes == b.block_hashes and a.block_hashes != c.block_hashes
    first = a.images[0].start // 128   # the block the image starts in, and every block after, differ
    assert a.block_hashes[:first] == c.block_hashes[:first]


async def test_no_live_vision_group_is_a_503(image_gateway):
    gateway, upstream, http, _, leader, _ = image_gateway
    leader.stop()
    await eventually(lambda: not gateway.members.alive(BALANCER_KIND), what="the leader to be gone", timeout=15)
    status, payload = await post(http, "/v1/chat/completions", chat(chat_image(data_url(SMALL))), "nogroup")
    assert status == 503 and payload["error"]["code"] == "vision_unavailable"
    assert upstream.requests == {}


async def test_a_low_detail_image_is_refused_not_billed_at_full_size(image_gateway):
    _, upstream, http, *_ = image_gateway
    part = {"type": "image_url", "image_url": {"url": data_url(SMALL), "detail": "low"}}
    status, payload = await post(http, "/v1/chat/completions", chat(part), "low")
    assert status == 400 and payload["error"]["code"] == "unsupported_parameter", payload
    assert "detail 'low'" in payload["error"]["message"] and payload["error"]["param"] == "messages[0].content[1]"
    status, payload = await post(http, "/v1/responses", {**responses(data_url(SMALL)), "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(SMALL), "detail": "low"}]}]}, "low2")
    assert status == 400, payload
    assert upstream.requests == {}
