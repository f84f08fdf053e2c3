"""The gateway in-process with a test router and a test streaming worker over real ZeroMQ: one
summary line per request with its chunk counts, aborts sent straight to the streaming worker,
orphan chunks answered with an abort, and a worker that dies failing its requests in seconds."""
from __future__ import annotations

import asyncio
import io
import json
import time

import aiohttp
import pytest
import structlog

from messages.control import StatusQuery
from ops.trace import timeline as trace
from messages.generate import GenerateChunk
from services.gateway.service import GatewayService
from services.runtime.config import ServiceConfig
from services.runtime.logs import configure_logging
from tests.gateway.conftest import MODEL
from tests.helpers.test_helper_async import eventually
from tests.helpers.test_helper_stack import free_port_base
from tests.helpers.test_helper_streaming_worker import TOKEN, TestHelperRouter, TestHelperStreamingWorker

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64,
        "thinking": {"type": "disabled"}}
FAST = {"heartbeat_s": 0.1, "dead_after": 3}   # a dead peer is noticed after 0.3 s
NO_RESUMES = {"max_resumes": 0}   # a dead worker's requests fail (test_gateway_resume.py: they resume)


async def start(cls, tmp_path, name: str, started: list, **fields):
    svc = cls(ServiceConfig(kind=cls.kind, instance=name, bind=f"ipc://{tmp_path}/{name}.sock", **{**FAST, **fields}))
    task = asyncio.create_task(svc.run(install_signals=False))
    started.append((svc, task))
    while svc.state == 0 and not task.done():
        await asyncio.sleep(0.01)
    assert not task.done(), f"{name} failed to start"
    return svc


@pytest.fixture
async def make_stack(tmp_path):
    """make_stack(**worker settings) -> (gateway, router, worker, http session, log lines)."""
    logs = io.StringIO()
    configure_logging("info", stream=logs)
    started: list = []     # (service, its run task), stopped in reverse
    sessions: list = []

    async def make(gateway_settings: dict | None = None, **worker_settings):
        worker = await start(TestHelperStreamingWorker, tmp_path, "worker", started, settings=worker_settings)
        router = await start(TestHelperRouter, tmp_path, "router", started,
                             settings={"worker": worker.config.advertise})
        port = free_port_base(1, offset=0)
        gateway = await start(GatewayService, tmp_path, "gw", started, upstream=router.config.advertise,
                              settings={"http_bind": f"127.0.0.1:{port}", "context_length": 4096,
                                        **(gateway_settings or {})})
        await eventually(lambda: gateway.upstream.connected, what="the gateway to register with the router")
        sessions.append(aiohttp.ClientSession(f"http://127.0.0.1:{port}"))
        return gateway, router, worker, sessions[-1], logs

    try:
        yield make
    finally:
        for session in sessions:
            await session.close()
        for svc, task in reversed(started):
            svc.stop()
            assert await task == 0
        structlog.reset_defaults()


def summaries(logs: io.StringIO, instance: str, request_id: str) -> list[dict]:
    lines = [json.loads(line) for line in logs.getvalue().splitlines()]
    return [x for x in lines if x["event"] == "request.summary" and x["instance"] == instance
            and x.get("request_id") == request_id]


async def test_one_summary_per_request_counts_its_chunks(make_stack):
    gateway, _, worker, http, logs = await make_stack(chunks=7, finish=True)
    async with http.post("/v1/chat/completions", json=BODY, headers={"x-request-id": "req-sum"}) as r:
        assert r.status == 200, await r.text()
        assert (await r.json())["usage"]["completion_tokens"] == 7
    [summary] = summaries(logs, "gw", "req-sum")        # none per GenerateChunk
    assert summary["chunks"] == worker.sent["req-sum"] == 8
    assert summary["outcome"] == "ok" and summary["worker"] == worker.config.advertise
    assert 0 <= summary["first_token_ms"] <= summary["last_token_ms"] <= summary["handle_ms"]
    assert 0 <= summary["gap_p50_ms"] <= summary["gap_max_ms"]
    timeline = trace.render(trace.read_trace(logs.getvalue().splitlines(), "req-sum"))   # what `epd trace` shows
    assert "stream.first_token" in timeline and "stream.last_token" in timeline and "8 chunks, gap p50=" in timeline


async def test_a_client_disconnect_aborts_at_the_streaming_worker_not_the_upstream(make_stack):
    gateway, router, worker, http, _ = await make_stack(chunks=2, finish=False)
    response = await http.post("/v1/chat/completions", json={**BODY, "stream": True},
                               headers={"x-request-id": "req-gone"})
    assert response.status == 200
    assert (await response.content.readline()).startswith(b"data: ")   # the stream is flowing
    await eventually(lambda: gateway.pending["req-gone"].worker, what="the gateway to learn the worker")
    response.close()                                                   # the client goes away
    await eventually(lambda: worker.aborts, what="the worker to get the abort")
    # first the disconnect's abort; a chunk already on its way then is answered "abandoned", and only that
    assert worker.aborts[0] == ("req-gone", "client_disconnected")
    assert set(worker.aborts[1:]) <= {("req-gone", "abandoned")}
    await gateway.call(router.config.advertise, StatusQuery())        # after anything sent there before
    assert router.aborts == []


async def test_a_chunk_for_a_request_the_gateway_does_not_hold_is_aborted_at_once(make_stack):
    gateway, _, worker, _, _ = await make_stack()
    worker.send_chunk(gateway.config.advertise, "req-ghost", GenerateChunk([TOKEN], worker=worker.config.advertise))
    await eventually(lambda: worker.aborts, what="the orphan chunk to be answered")
    assert worker.aborts == [("req-ghost", "abandoned")]


async def test_a_dead_worker_fails_its_stream_with_an_error_event_in_seconds(make_stack):
    gateway, _, worker, http, logs = await make_stack(NO_RESUMES, chunks=2, finish=False)
    async with http.post("/v1/chat/completions", json={**BODY, "stream": True},
                         headers={"x-request-id": "req-dead"}) as r:
        assert r.status == 200
        await eventually(lambda: gateway.pending["req-dead"].worker, what="the gateway to learn the worker")
        stopped = time.monotonic()
        worker.stop()                                                  # no goodbye: its sockets just close
        text = (await asyncio.wait_for(r.read(), 10)).decode()
    assert time.monotonic() - stopped < 10                             # chunk_timeout_s is 120 s
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    error = events[-1]["error"]
    assert error["code"] == "worker_died" and worker.config.advertise in error["message"]
    assert text.rstrip().endswith("data: [DONE]")
    [summary] = summaries(logs, "gw", "req-dead")
    assert summary["outcome"] == "worker_died" and summary["chunks"] == 2


async def test_a_dead_worker_fails_a_whole_answer_with_502_in_each_protocols_shape(make_stack):
    gateway, _, worker, http, _ = await make_stack(NO_RESUMES, chunks=1, finish=False)
    messages = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    chat = asyncio.create_task(http.post("/v1/chat/completions", json=BODY, headers={"x-request-id": "r-chat"}))
    claude = asyncio.create_task(http.post("/v1/messages", json=messages, headers={"x-request-id": "r-msg"}))
    await eventually(lambda: all(rid in gateway.pending and gateway.pending[rid].worker for rid in ("r-chat", "r-msg")),
                     what="both requests to stream from the worker")
    stopped = time.monotonic()
    worker.stop()
    chat_response, claude_response = await asyncio.wait_for(asyncio.gather(chat, claude), 10)
    assert time.monotonic() - stopped < 10
    assert chat_response.status == 502 and claude_response.status == 502
    openai_error = (await chat_response.json())["error"]
    assert openai_error["code"] == "worker_died" and worker.config.advertise in openai_error["message"]
    anthropic = await claude_response.json()
    assert anthropic["type"] == "error" and anthropic["error"]["type"] == "api_error"
    assert "died" in anthropic["error"]["message"]
    assert gateway.pending == {}


async def test_a_worker_restarted_at_the_same_address_fails_the_streams_its_old_process_held(make_stack, tmp_path):
    gateway, _, worker, http, _ = await make_stack(NO_RESUMES, chunks=1, finish=False)
    async with http.post("/v1/chat/completions", json={**BODY, "stream": True},
                         headers={"x-request-id": "req-restart"}) as r:
        assert r.status == 200
        await eventually(lambda: gateway.pending["req-restart"].worker, what="the gateway to learn the worker")
        worker.stop()
        started: list = []
        again = await start(TestHelperStreamingWorker, tmp_path, "worker", started)   # same address, new process
        try:
            assert again.config.advertise == worker.config.advertise and again.incarnation != worker.incarnation
            text = (await asyncio.wait_for(r.read(), 10)).decode()   # it answers status queries: not enough
        finally:
            again.stop()
            assert await started[0][1] == 0
    error = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")][-1]["error"]
    assert error["code"] == "worker_died"
    assert gateway.pending == {}
