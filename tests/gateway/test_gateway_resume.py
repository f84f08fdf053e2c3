"""Resuming a request whose worker died (services/gateway/resume.py), in-process over real ZeroMQ
with test-helper workers whose tokens depend on the position alone (like greedy decoding): the
client gets every token once, in order, as if nothing had happened; the next attempt carries the
tokens already streamed, what is left of max_tokens and the seeded-draw offset; an older attempt
that wakes up is stopped, and its tokens never reach the client; resumes are bounded."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest
import structlog

from messages.common import FinishReason, Usage
from messages.generate import GenerateChunk
from services.gateway.service import GatewayService
from tests.gateway.test_gateway_streams import BODY, FAST, start, summaries
from tests.helpers.test_helper_async import eventually
from tests.helpers.test_helper_stack import free_port_base
from tests.helpers.test_helper_streaming_worker import TestHelperRouter, TestHelperStreamingWorker, positional_token

WHOLE = {"chunks": 100, "finish": True, "positional": True}   # streams max_tokens tokens, then finishes
STALLS_AFTER = lambda n: {"chunks": n, "finish": False, "positional": True}   # noqa: E731


@pytest.fixture
async def resume_stack(tmp_path):
    """resume_stack(a settings, b settings, gateway settings) -> (gateway, router, a, b, http, logs):
    the router sends attempt k of a request to worker [a, b][k % 2]."""
    import io
    from services.runtime.logs import configure_logging
    logs = io.StringIO()
    configure_logging("info", stream=logs)
    started, sessions = [], []

    async def make(a: dict, b: dict, gateway_settings: dict | None = None):
        first = await start(TestHelperStreamingWorker, tmp_path, "a", started, settings=dict(a))
        second = await start(TestHelperStreamingWorker, tmp_path, "b", started, settings=dict(b))
        router = await start(TestHelperRouter, tmp_path, "router", started,
                             settings={"workers": [first.config.advertise, second.config.advertise]})
        port = free_port_base(1, offset=0)
        gateway = await start(GatewayService, tmp_path, "gw", started, upstream=router.config.advertise,
                              settings={"http_bind": f"127.0.0.1:{port}", "context_length": 4096,
                                        **(gateway_settings or {})})
        await eventually(lambda: gateway.upstream.connected, what="the gateway to register with the router")
        sessions.append(aiohttp.ClientSession(f"http://127.0.0.1:{port}"))
        return gateway, router, first, second, sessions[-1], logs

    try:
        yield make
    finally:
        for session in sessions:
            await session.close()
        for svc, task in reversed(started):
            svc.stop()
            await task
        structlog.reset_defaults()


async def answer(http, request_id: str, max_tokens: int = 8) -> tuple[int, dict]:
    async with http.post("/v1/chat/completions", json={**BODY, "max_tokens": max_tokens},
                         headers={"x-request-id": request_id}) as r:
        return r.status, await r.json()


async def reference(http, a, max_tokens: int = 8) -> dict:
    """The uninterrupted answer: worker a streams the whole request."""
    a.config.settings.update(WHOLE)
    status, body = await answer(http, "ref", max_tokens)
    assert status == 200, body
    return body


async def test_a_dead_workers_request_resumes_on_another_with_every_token_once(resume_stack):
    gateway, _, a, b, http, logs = await resume_stack(WHOLE, WHOLE)
    expected = await reference(http, a)
    a.config.settings.update(STALLS_AFTER(3))
    pending = asyncio.create_task(answer(http, "req-r"))
    await eventually(lambda: "req-r" in gateway.pending and len(gateway.pending["req-r"].token_ids) == 3,
                     what="three tokens from worker a")
    a.stop()                                                            # dies mid-stream
    status, body = await asyncio.wait_for(pending, 10)
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == expected["usage"]["prompt_tokens"]
    assert body["usage"]["completion_tokens"] == 8
    resumed = b.received["req-r#r1"]                                   # the next attempt's own wire id
    prompt = expected["usage"]["prompt_tokens"]
    assert resumed.prompt_ids[prompt:] == [positional_token(prompt + i) for i in range(3)]
    assert resumed.sampling.max_tokens == 5 and resumed.sampling.step_offset == 3 and resumed.exact_prefix
    [summary] = summaries(logs, "gw", "req-r")
    assert summary["resumes"] == 1 and summary["outcome"] == "ok" and summary["worker"] == b.config.advertise
    assert gateway.pending == {}


async def test_a_frozen_worker_that_wakes_up_is_stopped_and_its_tokens_never_shown(resume_stack):
    gateway, _, a, b, http, _ = await resume_stack(WHOLE, STALLS_AFTER(3))
    expected = await reference(http, a, max_tokens=5)
    a.config.settings.update(STALLS_AFTER(2))
    pending = asyncio.create_task(answer(http, "req-f"))
    await eventually(lambda: "req-f" in gateway.pending and gateway.pending["req-f"].worker,
                     what="worker a to stream")
    a.frozen = True                                                     # stops answering: declared dead
    await eventually(lambda: b.sent.get("req-f#r1") == 3, what="worker b to take over")
    a.frozen = False                                                    # wakes up, still generating
    a.send_chunk(gateway.config.advertise, "req-f", GenerateChunk([positional_token(9_999)]))
    await eventually(lambda: ("req-f", "abandoned") in a.aborts, what="the old attempt to be stopped")
    b.send_chunk(gateway.config.advertise, "req-f#r1",
                 GenerateChunk([], int(FinishReason.STOP), usage=Usage(len(b.received["req-f#r1"].prompt_ids), 0, 3)))
    status, body = await asyncio.wait_for(pending, 10)
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] == 5
    assert b.received["req-f#r1"].sampling.step_offset == 2


async def test_resumes_are_bounded_then_the_request_fails_in_its_protocols_shape(resume_stack):
    gateway, _, a, b, http, logs = await resume_stack(STALLS_AFTER(1), STALLS_AFTER(1), {"max_resumes": 1})
    pending = asyncio.create_task(answer(http, "req-b"))
    await eventually(lambda: "req-b" in gateway.pending and gateway.pending["req-b"].worker, what="worker a")
    a.stop()
    await eventually(lambda: "req-b#r1" in gateway.pending and gateway.pending["req-b#r1"].worker, what="worker b")
    b.stop()
    status, body = await asyncio.wait_for(pending, 10)
    assert status == 502 and body["error"]["code"] == "worker_died"
    assert b.config.advertise in body["error"]["message"]
    [summary] = summaries(logs, "gw", "req-b")
    assert summary["resumes"] == 1 and summary["outcome"] == "worker_died"
    assert gateway.pending == {}


async def test_a_request_the_restarted_router_lost_is_sent_again_once_it_is_back(resume_stack, tmp_path):
    gateway, router, a, b, http, _ = await resume_stack({"chunks": 0, "finish": False}, WHOLE)
    pending = asyncio.create_task(answer(http, "req-u", max_tokens=4))
    await eventually(lambda: "req-u" in a.received, what="the first attempt to reach worker a")
    router.stop()                                    # a's attempt will never stream; the router is gone
    await eventually(lambda: not gateway.upstream.connected, what="the gateway to notice")
    restarted: list = []
    again = await start(TestHelperRouter, tmp_path, "router", restarted,
                        settings={"workers": [a.config.advertise, b.config.advertise]})
    try:
        status, body = await asyncio.wait_for(pending, 15)
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 4 and "req-u#r1" in b.received
    finally:
        again.stop()
        await restarted[0][1]


async def test_a_prefill_ranks_death_reported_after_the_stream_began_is_not_a_resume(resume_stack):
    """The prefill rank can die after its hand-off but before the router heard PrefillDone: the
    router's PEER_DEAD then concerns a request a decode worker already streams. It carries on."""
    from messages import ErrorReply
    from messages.errors import ErrorCode
    gateway, router, a, b, http, logs = await resume_stack(STALLS_AFTER(2), WHOLE)
    pending = asyncio.create_task(answer(http, "req-p", max_tokens=3))
    await eventually(lambda: "req-p" in gateway.pending and len(gateway.pending["req-p"].token_ids) == 2,
                     what="worker a to stream")
    router.send(gateway.config.advertise, ErrorReply(int(ErrorCode.PEER_DEAD), "prefill rank p-0 died holding the "
                "request"), request_id="req-p")
    await eventually(lambda: any('"request.failure_ignored"' in line for line in logs.getvalue().splitlines()),
                     what="the gateway to read the error")
    a.send_chunk(gateway.config.advertise, "req-p", GenerateChunk([positional_token(99)], int(FinishReason.LENGTH),
                                                                  usage=Usage(10, 0, 3)))
    status, body = await asyncio.wait_for(pending, 10)
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    assert b.received == {}                                            # never resumed


async def test_a_request_id_already_in_flight_gets_its_own_suffix(resume_stack):
    """Two requests under one client-given x-request-id must not share the gateway's entry (each
    would get the other's chunks): the second one gets a unique suffix, named in its answer."""
    gateway, _, a, _, http, _ = await resume_stack(STALLS_AFTER(1), WHOLE)

    async def post():
        async with http.post("/v1/chat/completions", json={**BODY, "max_tokens": 2},
                             headers={"x-request-id": "req-d"}) as r:
            return r.headers["x-request-id"], await r.json()
    first = asyncio.create_task(post())
    await eventually(lambda: "req-d" in a.received, what="the first request at worker a")
    second = asyncio.create_task(post())
    await eventually(lambda: len(a.received) == 2, what="the second request at worker a")
    ids = sorted(a.received)
    assert ids[0] == "req-d" and ids[1].startswith("req-d-")
    for wire in ids:
        a.send_chunk(gateway.config.advertise, wire, GenerateChunk([positional_token(1)], int(FinishReason.LENGTH),
                                                                   usage=Usage(10, 0, 2)))
    answers = await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert sorted(rid for rid, _ in answers) == ids
    assert all(body["usage"]["completion_tokens"] == 2 for _, body in answers)
