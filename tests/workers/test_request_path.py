"""The E/P/D request path in-process over real ZeroMQ (prefill router, decode router, prefill and
decode workers, KV writer, SWA registry; a test-helper gateway): a cache hit makes at most one
blocking call before the first prefill step, and a request that finds every decode worker full
waits for room instead of being refused; a client's abort goes from the gateway straight to the
decode worker that streams it, never through a router."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest

from messages.common import FinishReason
from messages.generate import GenerateChunk, GenerateRequest
from messages.prefix import block_hashes
from services.decode_router.service import DecodeRouterService
from services.gateway.service import GatewayService
from services.kv_writer.service import KvWriterService
from services.prefill_router.service import PrefillRouterService
from services.runtime.service import Service
from services.swa_registry.service import SwaRegistryService
from services.workers.decode import DecodeWorker
from services.workers.prefill import PrefillWorker
from tests.conftest import MODEL_NAME
from tests.engine.references import greedy_params, make_prompt
from tests.helpers.test_helper_async import eventually
from tests.helpers.test_helper_services import InProcessServices
from tests.helpers.test_helper_stack import free_port_base
from tests.workers.test_workers_inprocess import TestHelperGateway, engine_settings

class PathStack(InProcessServices):
    async def generate(self, rid: str, prompt: list[int], max_tokens: int) -> list[GenerateChunk]:
        request = GenerateRequest(model="tiny", prompt_ids=prompt, sampling=greedy_params(max_tokens),
                                  block_hashes=block_hashes(self.decode.model_id, prompt),
                                  return_address=self.gw.config.advertise)
        self.gw.send(self.router.config.advertise, request, request_id=rid)
        await eventually(lambda: self.gw.finished(rid), timeout=120, what=f"{rid} finished")
        return self.gw.chunks[rid]


async def start_path(tmp_path, model_dir, decode_capacity: int = 0) -> PathStack:
    s = PathStack(tmp_path)
    store = str(tmp_path / "kvstore")
    s.kv = await s.start(KvWriterService, "kv", {"root": store})
    s.swa = await s.start(SwaRegistryService, "swa")
    s.decode_router = await s.start(DecodeRouterService, "decode-router")
    s.router = await s.start(PrefillRouterService, "router", {"kv_store_dir": store,
                                                               "decode_router": s.decode_router.config.advertise})
    peers = {"kv_writer": s.kv.config.advertise, "swa_registry": s.swa.config.advertise}
    s.decode = await s.start(DecodeWorker, "decode", {**engine_settings(model_dir), **peers,
                                                      "capacity": decode_capacity},
                             upstream=s.decode_router.config.advertise)
    s.prefill = await s.start(PrefillWorker, "prefill", {**engine_settings(model_dir), **peers, "kv_store_dir": store},
                              upstream=s.router.config.advertise)
    s.gw = await s.start(TestHelperGateway, "gw")
    await eventually(lambda: s.router.members.alive("prefill_worker") and s.router.decode.workers() == 1,
                     timeout=10, what="both pools known to the router")
    return s


@pytest.fixture
async def path(tmp_path, tiny_model_dir):
    s = await start_path(tmp_path, tiny_model_dir)
    yield s
    await s.close()


@pytest.fixture
def blocking_calls(monkeypatch):
    """Every Service.call made for a request: (service kind, message type, request id)."""
    made: list[tuple[str, str, str]] = []
    real_call = Service.call

    async def counting_call(self, address, message, *, request_id="", **kwargs):
        if request_id:
            made.append((self.kind, type(message).__name__, request_id))
        return await real_call(self, address, message, request_id=request_id, **kwargs)

    monkeypatch.setattr(Service, "call", counting_call)
    return made


def calls_before_prefill(s: PathStack, made: list, rid: str) -> list:
    """What `made` held for `rid` when the prefill worker's engine took the request."""
    seen: dict[str, list] = {}
    engine = s.prefill.engine_thread.engine
    real_add = engine.add_request

    def add_request(request, **kwargs):
        seen.setdefault(request.request_id, [c for c in made if c[2] == request.request_id])
        return real_add(request, **kwargs)

    engine.add_request = add_request
    return seen


async def test_a_cache_hit_makes_at_most_one_blocking_call_before_its_first_prefill_step(path, blocking_calls):
    s = path
    seen = calls_before_prefill(s, blocking_calls, "")
    prompt = make_prompt(300, 21).tolist()
    first = await s.generate("cold", prompt, 100)
    assert seen["cold"] == []                        # no hit: nothing to ask anyone
    tokens = prompt + [t for c in first for t in c.token_ids]
    hashes = block_hashes(s.decode.model_id, tokens)
    await eventually(lambda: s.kv.store.lookup(hashes) == 3 and s.swa.registry.lookup(hashes[2:3])[0],
                     timeout=20, what="blocks persisted and the window at 384 advertised by the decode worker")

    # the continued conversation: 384 tokens in the store, the window at 384 on the decode worker
    second = tokens[:384] + make_prompt(140, 22).tolist()
    chunks = await s.generate("hit", second, 4)
    assert chunks[-1].usage.cached_tokens == 384
    assert seen["hit"] == [("prefill_worker", "SwaFetch", "hit")]   # the one call: the window, forwarded
    assert all(kind == "prefill_worker" for kind, _, rid in blocking_calls if rid == "hit")   # routers: none


async def test_every_decode_worker_full_means_waiting_not_refusal(tmp_path, tiny_model_dir):
    s = await start_path(tmp_path, tiny_model_dir, decode_capacity=1)
    most = 0

    async def watch_decode_batch():
        nonlocal most
        while True:
            most = max(most, len(s.decode.streams))
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch_decode_batch())
    try:
        prompts = [make_prompt(40, 30 + i).tolist() for i in range(3)]
        for i, prompt in enumerate(prompts):
            request = GenerateRequest(model="tiny", prompt_ids=prompt, sampling=greedy_params(24),
                                      return_address=s.gw.config.advertise)
            s.gw.send(s.router.config.advertise, request, request_id=f"r{i}")
        await eventually(lambda: all(s.gw.finished(f"r{i}") for i in range(3)), timeout=120, what="all three finished")
        for i in range(3):
            last = s.gw.chunks[f"r{i}"][-1]
            assert last.finish_reason == int(FinishReason.LENGTH) and len(s.gw.tokens(f"r{i}")) == 24
        assert s.router.core.stats.expired == 0 and s.router.core.stats.refused == 0
        assert most == 1                                   # they took turns on the one decode slot
        await eventually(lambda: s.router.decode.held() == 0, timeout=10, what="every reservation settled")
    finally:
        watcher.cancel()
        await s.close()


async def test_a_client_abort_reaches_the_decode_worker_without_passing_through_a_router(path, tiny_model_dir):
    s = path
    port = free_port_base(1, offset=0)
    gateway = await s.start(GatewayService, "gateway", {"http_bind": f"127.0.0.1:{port}", "model_dir": str(tiny_model_dir),
                                                        "context_length": 4096},
                            upstream=s.router.config.advertise)
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 3000,
            "stream": True, "thinking": {"type": "disabled"}}
    async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
        response = await http.post("/v1/chat/completions", json=body)
        assert response.status == 200
        events = 0
        async for line in response.content:
            events += line.startswith(b"data: ")
            if events >= 5:
                break
        assert len(s.decode.streams) == 1
        response.close()                                  # the client goes away mid-stream
    await eventually(lambda: len(s.decode.streams) == 0, timeout=10, what="the decode worker freed the request")
    received = s.router.metrics.registry.get_sample_value
    labels = {"kind": "prefill_router", "instance": "router"}
    assert received("epd_messages_in_total", {**labels, "type": "AbortRequest"}) is None   # never via the router
    assert s.decode.metrics.registry.get_sample_value(
        "epd_messages_in_total", {"kind": "decode_worker", "instance": "decode", "type": "AbortRequest"}) == 1
    assert gateway.in_flight() == 0
