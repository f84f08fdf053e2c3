"""The gateway as a draining service, in-process over real ZeroMQ with a test router and a test
streaming worker: once it drains, new HTTP requests get 503 in the protocol's shape and /health says
503, while the chunks of the stream it holds still reach the client (its continuation_types); when
the grace period runs out first, the stream ends with an error event, not a cut connection, and the
gateway stops at once instead of waiting on its HTTP handlers."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from messages.control import ServiceState
from messages.generate import GenerateChunk
from services.gateway.service import GatewayService
from services.runtime.config import ServiceConfig
from tests.helpers.test_helper_async import eventually
from tests.helpers.test_helper_stack import free_port_base
from tests.helpers.test_helper_streaming_worker import TOKEN, TestHelperRouter, TestHelperStreamingWorker

MODEL = "deepseek-v4-tiny"   # the gateway's name for its built-in V4 tokenizer (no model directory)
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64, "stream": True,
        "thinking": {"type": "disabled"}}
FAST = {"heartbeat_s": 0.1, "dead_after": 5}
GRACE_S = 2.0


async def start(cls, tmp_path, name: str, tasks: list, **fields):
    svc = cls(ServiceConfig(kind=cls.kind, instance=name, bind=f"ipc://{tmp_path}/{name}.sock", **FAST, **fields))
    task = asyncio.create_task(svc.run(install_signals=False))
    tasks.append((svc, task))
    await eventually(lambda: svc.state != ServiceState.STARTING or task.done(), 60, f"{name} to start")
    assert not task.done(), f"{name} failed to start"
    return svc


def chunks_held(gateway: GatewayService) -> int:
    """Chunks the gateway took for the open request "req-held"."""
    request = gateway.pending.get("req-held")
    return request.stats.chunks if request else 0


async def test_a_draining_gateway_refuses_new_work_finishes_held_streams_and_ends_them_at_grace(tmp_path):
    tasks: list = []
    port = free_port_base(1, offset=0)
    try:
        worker = await start(TestHelperStreamingWorker, tmp_path, "worker", tasks,
                             settings={"chunks": 2, "finish": False})   # the stream stays open
        router = await start(TestHelperRouter, tmp_path, "router", tasks, settings={"worker": worker.config.advertise})
        gateway = await start(GatewayService, tmp_path, "gw", tasks, upstream=router.config.advertise,
                              settings={"http_bind": f"127.0.0.1:{port}", "context_length": 4096, "max_resumes": 0})
        gateway_task = tasks[-1][1]
        await eventually(lambda: gateway.upstream.connected, what="the gateway to register with the router")
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
            stream = await http.post("/v1/chat/completions", json=BODY, headers={"x-request-id": "req-held"})
            assert stream.status == 200
            await eventually(lambda: chunks_held(gateway) == 2, what="the worker's first two chunks")
            gateway.begin_drain(grace_s=GRACE_S)
            assert gateway.state == ServiceState.DRAINING

            late = await http.post("/v1/chat/completions", json={**BODY, "stream": False})
            assert late.status == 503 and "shutting down" in (await late.json())["error"]["message"]
            health = await http.get("/health")
            assert health.status == 503 and (await health.json())["state"] == "draining"

            worker.send_chunk(gateway.config.advertise, "req-held", GenerateChunk([TOKEN]))   # held work goes on
            await eventually(lambda: chunks_held(gateway) == 3, what="a draining gateway to take its stream's chunk")

            began = time.monotonic()                             # no last chunk comes: the grace period runs out
            text = (await asyncio.wait_for(stream.read(), GRACE_S + 10)).decode()
            assert await asyncio.wait_for(gateway_task, 10) == 0
            assert time.monotonic() - began < GRACE_S + 5       # not aiohttp's 60 s wait on its handlers
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        assert sum(bool(e.get("choices") and e["choices"][0]["delta"].get("content")) for e in events) == 3
        assert events[-1]["error"]["code"] == "shutting_down"
        assert "stopped before the answer was complete" in events[-1]["error"]["message"]
        assert text.rstrip().endswith("data: [DONE]")
        assert worker.aborts == [("req-held", "shutting_down")]
    finally:
        for svc, task in reversed(tasks):
            svc.stop()
            assert await task == 0
