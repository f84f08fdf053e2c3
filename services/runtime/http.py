"""HTTP side door of a service: GET /metrics (Prometheus) and GET /health (200 only when RUNNING)."""
from __future__ import annotations

import asyncio

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from messages.control import ServiceState


async def serve_metrics(service) -> None:
    async def metrics(_request):
        return web.Response(body=service.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(_request):
        state = ServiceState(service.state)
        body = {"instance": service.config.instance, "kind": service.kind, "state": state.name.lower()}
        return web.json_response(body, status=200 if state == ServiceState.RUNNING else 503)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host, _, port = service.config.metrics_bind.rpartition(":")
    site = web.TCPSite(runner, host or "127.0.0.1", int(port))
    await site.start()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
