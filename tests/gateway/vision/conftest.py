"""Test-only helpers for the gateway's image path: local aiohttp servers on loopback addresses,
a scripted DNS resolver, and small images made with Pillow."""
from __future__ import annotations

import io
import socket
from contextlib import asynccontextmanager

import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver
from PIL import Image

from services.gateway.vision import ImageFetcher, ImageLimits

SERVED = "127.0.0.2"        # the test server's address: allowed by the limits below, loopback all the same
FORBIDDEN_LOCAL = "127.0.0.1"


class ScriptedResolverForTests(AbstractResolver):
    """Answers each lookup with the next list of addresses in `answers` (the last one repeats),
    recording every (host, answer): a name resolving to a private address, or DNS rebinding."""

    def __init__(self, *answers: list[str]) -> None:
        self.answers = list(answers)
        self.lookups: list[tuple[str, list[str]]] = []

    async def resolve(self, host, port=0, family=socket.AF_INET):
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        self.lookups.append((host, answer))
        return [{"hostname": host, "host": address, "port": port,
                 "family": socket.AF_INET6 if ":" in address else socket.AF_INET, "proto": 0, "flags": 0}
                for address in answer]

    async def close(self) -> None:
        pass


class ServerForTests:
    """An aiohttp app on one loopback address; `hits` lists the paths it was asked for."""

    def __init__(self, host: str, port: int, hits: list[str]) -> None:
        self.host, self.port, self.hits = host, port, hits

    def url(self, path: str = "/", host: str | None = None) -> str:
        return f"http://{host or self.host}:{self.port}{path}"


@asynccontextmanager
async def serve_for_tests(routes: dict, host: str = SERVED, port: int = 0):
    """Serve `routes` ({path: handler}) on host:port (0: any free port) until the block ends."""
    hits: list[str] = []

    @web.middleware
    async def record(request, handler):
        hits.append(request.path)
        return await handler(request)

    app = web.Application(middlewares=[record])
    for path, handler in routes.items():
        app.router.add_get(path, handler)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    try:
        yield ServerForTests(host, runner.addresses[0][1], hits)
    finally:
        await runner.cleanup()


def image_bytes_for_tests(width: int = 40, height: int = 30, fmt: str = "PNG", color=(200, 30, 90)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format=fmt)
    return buffer.getvalue()


def limits_for_tests(**fields) -> ImageLimits:
    """Small, fast limits; the test server's address is the operator allowlist."""
    defaults = dict(max_bytes=4096, max_data_url_chars=8192, total_timeout_s=5.0, connect_timeout_s=2.0,
                    allow_networks=(f"{SERVED}/32",))
    defaults.update(fields)
    return ImageLimits(**defaults)


@pytest.fixture
async def fetcher():
    async with ImageFetcher(limits_for_tests()) as fetcher:
        yield fetcher
