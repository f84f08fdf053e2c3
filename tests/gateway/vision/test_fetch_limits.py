"""Size, time and HTTP failures of an image fetch, and data URLs: each a typed ImageFetchError."""
from __future__ import annotations

import asyncio
import base64
import socket
from urllib.parse import quote_from_bytes

import pytest
from aiohttp import web

from services.gateway.vision import ImageFetcher, ImageFetchError, ImageLimits
from tests.gateway.vision.conftest import SERVED, image_bytes_for_tests, limits_for_tests, serve_for_tests

PNG = image_bytes_for_tests()
LIMIT = limits_for_tests().max_bytes


async def _code_of(fetcher: ImageFetcher, url: str) -> str:
    with pytest.raises(ImageFetchError) as caught:
        await fetcher.fetch(url)
    return caught.value.code


async def test_an_image_over_the_limit_is_refused_from_its_content_length(fetcher):
    async def big(request):
        response = web.StreamResponse(headers={"Content-Length": str(LIMIT + 1), "Content-Type": "image/png"})
        await response.prepare(request)
        await response.write(b"x" * 100)     # the rest never comes: the header alone decides
        return response

    async with serve_for_tests({"/big": big}) as server:
        assert await _code_of(fetcher, server.url("/big")) == "image_too_large"


async def test_a_chunked_image_is_cut_off_once_it_passes_the_limit(fetcher):
    async def endless(request):
        response = web.StreamResponse(headers={"Content-Type": "image/png"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        for _ in range(1000):                # far past the limit; the client stops reading at it
            await response.write(b"x" * 1024)
        return response

    async with serve_for_tests({"/endless": endless}) as server:
        assert await _code_of(fetcher, server.url("/endless")) == "image_too_large"


async def test_an_image_at_the_limit_is_fetched(fetcher):
    async def exact(request):
        return web.Response(body=b"y" * LIMIT)

    async with serve_for_tests({"/exact": exact}) as server:
        assert len(await fetcher.fetch(server.url("/exact"))) == LIMIT


@pytest.mark.parametrize("stall_after_headers", [False, True])
async def test_a_server_that_stalls_hits_the_total_time_limit(stall_after_headers):
    release = asyncio.Event()

    async def stall(request):
        if stall_after_headers:
            response = web.StreamResponse(headers={"Content-Length": "100"})
            await response.prepare(request)
            await response.write(b"z" * 10)
        await release.wait()                  # set only when the test is over
        return web.Response(body=b"late")

    async with serve_for_tests({"/stall": stall}) as server:
        try:
            async with ImageFetcher(limits_for_tests(total_timeout_s=0.2)) as fetcher:
                assert await _code_of(fetcher, server.url("/stall")) == "image_fetch_timeout"
        finally:
            release.set()


async def test_an_http_error_status_is_a_fetch_failure(fetcher):
    async def missing(request):
        raise web.HTTPNotFound()

    async with serve_for_tests({"/missing": missing}) as server:
        with pytest.raises(ImageFetchError) as caught:
            await fetcher.fetch(server.url("/missing"))
    assert caught.value.code == "image_fetch_failed" and "HTTP 404" in caught.value.message


async def test_a_refused_connection_is_a_fetch_failure(fetcher):
    with socket.socket() as unused:          # bound, never listening: the port refuses connections
        unused.bind((SERVED, 0))
        port = unused.getsockname()[1]
        assert await _code_of(fetcher, f"http://{SERVED}:{port}/a.png") == "image_fetch_failed"


async def test_a_base64_data_url_is_decoded(fetcher):
    encoded = base64.b64encode(PNG).decode()
    assert await fetcher.fetch(f"data:image/png;base64,{encoded}") == PNG
    assert await fetcher.fetch(f"DATA:Image/PNG;BASE64,{encoded.rstrip('=')}") == PNG   # case, no padding
    assert await fetcher.fetch(f"data:image/png;base64,{encoded[:8]}\n{encoded[8:]}") == PNG


async def test_a_percent_encoded_data_url_is_decoded(fetcher):
    assert await fetcher.fetch("data:image/png," + quote_from_bytes(PNG)) == PNG


@pytest.mark.parametrize("url, code", [
    ("data:image/png;base64,!!!notbase64", "invalid_image_url"),
    ("data:image/png;base64,A", "invalid_image_url"),
    ("data:text/plain;base64,aGVsbG8=", "invalid_image_url"),
    ("data:,hello", "invalid_image_url"),
    ("data:image/png;base64", "invalid_image_url"),
    ("data:image/png;base64,", "invalid_image_url"),
])
async def test_bad_data_urls_are_refused(fetcher, url, code):
    assert await _code_of(fetcher, url) == code


async def test_data_urls_over_the_limits_are_refused(fetcher):
    over_bytes = base64.b64encode(b"p" * (LIMIT + 1)).decode()
    assert await _code_of(fetcher, f"data:image/png;base64,{over_bytes}") == "image_too_large"
    over_chars = "A" * limits_for_tests().max_data_url_chars
    assert await _code_of(fetcher, f"data:image/png;base64,{over_chars}") == "image_too_large"


def test_limits_are_checked_when_built():
    with pytest.raises(ValueError, match="allow_networks"):
        ImageLimits(allow_networks=["10.0.0.0/33"])
    with pytest.raises(ValueError, match="max_bytes"):
        ImageLimits(max_bytes=0)
    assert ImageLimits(allow_networks=["10.0.0.0/8"]).allow_networks == ("10.0.0.0/8",)
