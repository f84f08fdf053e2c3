"""ImageResolver: sources -> ImageInputs with digests and V4.1 grids; errors name the image's path."""
from __future__ import annotations

import base64
import hashlib

import pytest
from aiohttp import web

from messages.images import VisionSizing, plan_image_grid
from services.gateway.vision import ImageFetcher, ImageInputError, ImageResolver
from tests.gateway.vision.conftest import image_bytes_for_tests, limits_for_tests, serve_for_tests

SIZING = VisionSizing()
RED = image_bytes_for_tests(40, 30, color=(255, 0, 0))
BLUE = image_bytes_for_tests(40, 30, color=(0, 0, 255))


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


async def _resolver(**limits) -> ImageResolver:
    return ImageResolver(ImageFetcher(limits_for_tests(**limits)), SIZING)


async def test_the_same_image_has_the_same_digest_however_it_arrives():
    async def red(request):
        return web.Response(body=RED, content_type="image/png")

    resolver = await _resolver()
    async with resolver.fetcher, serve_for_tests({"/red.png": red}) as server:
        images = await resolver.resolve([("url", _data_url(RED), "messages[0].content[0]"),
                                         ("bytes", RED, "messages[0].content[1]"),
                                         ("url", server.url("/red.png"), "messages[0].content[2]"),
                                         ("url", _data_url(BLUE), "messages[1].content[0]")])
    assert [image.digest for image in images[:3]] == [hashlib.sha256(RED).digest()] * 3
    assert images[3].digest == hashlib.sha256(BLUE).digest() != images[0].digest
    first = images[0]
    assert (first.width, first.height, first.data, first.start) == (40, 30, RED, -1)
    assert first.grid == plan_image_grid(40, 30, SIZING)


async def test_larger_images_plan_more_tokens():
    resolver = await _resolver(max_bytes=1 << 20, max_data_url_chars=2 << 20)
    small, large = image_bytes_for_tests(100, 100), image_bytes_for_tests(1400, 1000)
    async with resolver.fetcher:
        images = await resolver.resolve([("bytes", small, "a"), ("bytes", large, "b")])
    assert images[0].grid.tokens < images[1].grid.tokens


async def test_an_error_names_the_failing_image_not_its_neighbours():
    resolver = await _resolver()
    sources = [("url", _data_url(RED), "messages[0].content[0]"),
               ("bytes", b"not an image", "messages[0].content[1]"),
               ("url", _data_url(BLUE), "messages[2].content[0]")]
    async with resolver.fetcher:
        with pytest.raises(ImageInputError) as caught:
            await resolver.resolve(sources)
    assert (caught.value.code, caught.value.path) == ("invalid_image", "messages[0].content[1]")


@pytest.mark.parametrize("source, code", [
    (("url", "http://169.254.169.254/latest", "p"), "image_url_forbidden"),
    (("url", "file:///etc/passwd", "p"), "image_url_forbidden"),
    (("url", "data:text/plain,hi", "p"), "invalid_image_url"),
    (("bytes", b"x" * 5000, "p"), "image_too_large"),
    (("bytes", RED, "p"), "image_too_large"),           # 40 x 30 pixels, over max_pixels below
    (("bytes", image_bytes_for_tests(20, 20)[:60], "p"), "invalid_image"),   # truncated
])
async def test_each_failure_is_a_typed_error_at_its_path(source, code):
    resolver = await _resolver(max_pixels=1000)
    async with resolver.fetcher:
        with pytest.raises(ImageInputError) as caught:
            await resolver.resolve([source])
    assert (caught.value.code, caught.value.path) == (code, "p")


async def test_per_request_limits_on_count_and_total_bytes():
    resolver = await _resolver(max_images=2, max_total_bytes=len(RED) + len(BLUE) - 1)
    async with resolver.fetcher:
        with pytest.raises(ImageInputError) as caught:
            await resolver.resolve([("bytes", RED, "a"), ("bytes", RED, "b"), ("bytes", RED, "c")])
        assert (caught.value.code, caught.value.path) == ("too_many_images", "c")
        with pytest.raises(ImageInputError) as caught:
            await resolver.resolve([("bytes", RED, "a"), ("bytes", BLUE, "b")])
        assert caught.value.code == "image_too_large"
        assert await resolver.resolve([]) == []


async def test_a_source_of_an_unknown_kind_is_a_programming_error():
    resolver = await _resolver()
    with pytest.raises(ExceptionGroup) as caught:
        await resolver.resolve([("file", "/etc/passwd", "p")])
    assert caught.group_contains(TypeError)
