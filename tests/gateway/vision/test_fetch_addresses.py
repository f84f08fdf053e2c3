"""The image fetcher connects only to allowed addresses: literal IPs, resolved names, DNS
rebinding, redirects and schemes (issue #13: SSRF-style URLs get a 400, never a fetch)."""
from __future__ import annotations

import pytest
from aiohttp import web

from services.gateway.vision import ImageFetcher, ImageFetchError
from tests.gateway.vision.conftest import (
    FORBIDDEN_LOCAL, SERVED, ScriptedResolverForTests, image_bytes_for_tests, limits_for_tests,
    serve_for_tests,
)

PNG = image_bytes_for_tests()


async def _png(request):
    return web.Response(body=PNG, content_type="image/png")


async def _png_then_close(request):
    """No keep-alive: the client's next fetch opens a new connection, so it resolves again."""
    return web.Response(body=PNG, content_type="image/png", headers={"Connection": "close"})


async def _refused(fetcher: ImageFetcher, url: str, code: str = "image_url_forbidden") -> ImageFetchError:
    with pytest.raises(ImageFetchError) as caught:
        await fetcher.fetch(url)
    assert caught.value.code == code, caught.value
    return caught.value


async def test_an_allowlisted_server_is_fetched(fetcher):
    async with serve_for_tests({"/a.png": _png}) as server:
        assert await fetcher.fetch(server.url("/a.png")) == PNG
        assert server.hits == ["/a.png"]


@pytest.mark.parametrize("host", ["127.0.0.1", "10.0.0.1", "169.254.169.254", "[::1]",
                                  "[::ffff:127.0.0.1]", "[::ffff:169.254.169.254]", "0.0.0.0",
                                  "[fe80::1]", "192.168.0.1"])
async def test_literal_private_loopback_and_metadata_addresses_are_refused(fetcher, host):
    error = await _refused(fetcher, f"http://{host}/latest/meta-data/")
    assert "may not point to" in error.message


async def test_a_refused_literal_address_is_never_connected_to(fetcher):
    async with serve_for_tests({"/a.png": _png}, host=FORBIDDEN_LOCAL) as local:
        await _refused(fetcher, local.url("/a.png"))
        await _refused(fetcher, local.url("/a.png", host="[::ffff:127.0.0.1]"))
        assert local.hits == []


@pytest.mark.parametrize("url", ["http://2130706433/", "http://127.1/", "http://0x7f000001/", "http://localhost/"])
async def test_other_spellings_of_loopback_are_refused(url):
    async with ImageFetcher(limits_for_tests()) as fetcher:
        with pytest.raises(ImageFetchError) as caught:
            await fetcher.fetch(url)
        assert caught.value.code in ("image_url_forbidden", "invalid_image_url")


@pytest.mark.parametrize("answer", [["169.254.169.254"], ["10.0.0.1"], ["::1"], ["::ffff:127.0.0.1"],
                                    ["fd00::1", "100.64.0.1"]])
async def test_a_name_resolving_only_to_private_addresses_is_refused(answer):
    resolver = ScriptedResolverForTests(answer)
    async with ImageFetcher(limits_for_tests(), resolver=resolver) as fetcher:
        error = await _refused(fetcher, "http://images.example.com/a.png")
    assert "resolves to" in error.message and resolver.lookups == [("images.example.com", answer)]


async def test_only_the_allowed_answers_of_a_mixed_lookup_are_connected_to():
    async with serve_for_tests({"/a.png": _png}, host=FORBIDDEN_LOCAL) as local, \
               serve_for_tests({"/a.png": _png}, port=local.port) as allowed:
        resolver = ScriptedResolverForTests([FORBIDDEN_LOCAL, SERVED])
        async with ImageFetcher(limits_for_tests(), resolver=resolver) as fetcher:
            assert await fetcher.fetch(f"http://images.example.com:{local.port}/a.png") == PNG
        assert (local.hits, allowed.hits) == ([], ["/a.png"])


async def test_dns_rebinding_connects_to_the_address_that_was_checked():
    """The name answers an allowed address, then 127.0.0.1: each fetch does one lookup and
    connects to exactly what that lookup returned after the check; the rebound answer is refused."""
    async with serve_for_tests({"/a.png": _png}, host=FORBIDDEN_LOCAL) as local, \
               serve_for_tests({"/a.png": _png_then_close}, port=local.port) as allowed:
        resolver = ScriptedResolverForTests([SERVED], [FORBIDDEN_LOCAL])
        url = f"http://rebind.example.com:{local.port}/a.png"
        async with ImageFetcher(limits_for_tests(), resolver=resolver) as fetcher:
            assert await fetcher.fetch(url) == PNG
            assert resolver.lookups == [("rebind.example.com", [SERVED])]
            assert (allowed.hits, local.hits) == (["/a.png"], [])
            await _refused(fetcher, url)
        assert [answer for _, answer in resolver.lookups] == [[SERVED], [FORBIDDEN_LOCAL]]
        assert local.hits == []


async def test_a_redirect_to_loopback_from_an_allowed_server_is_refused(fetcher):
    async with serve_for_tests({"/a.png": _png}, host=FORBIDDEN_LOCAL) as local:
        async def to_local(request):
            raise web.HTTPFound(local.url("/a.png"))

        async def to_metadata(request):
            raise web.HTTPTemporaryRedirect("http://169.254.169.254/latest/meta-data/")

        async with serve_for_tests({"/local": to_local, "/metadata": to_metadata}) as server:
            await _refused(fetcher, server.url("/local"))
            await _refused(fetcher, server.url("/metadata"))
            assert server.hits == ["/local", "/metadata"] and local.hits == []


async def test_a_redirect_to_a_name_resolving_to_a_private_address_is_refused():
    resolver = ScriptedResolverForTests(["10.1.2.3"])

    async def to_name(request):
        raise web.HTTPMovedPermanently("http://internal.example.com/a.png")

    async with serve_for_tests({"/r": to_name}) as server:
        async with ImageFetcher(limits_for_tests(), resolver=resolver) as fetcher:
            await _refused(fetcher, server.url("/r"))
    assert resolver.lookups == [("internal.example.com", ["10.1.2.3"])]


async def test_redirects_within_the_limit_are_followed_and_one_more_is_refused(fetcher):
    async def hop(request):
        left = int(request.match_info["left"])
        raise web.HTTPFound(f"/hop/{left - 1}" if left > 0 else "/a.png")

    async with serve_for_tests({"/hop/{left}": hop, "/a.png": _png}) as server:
        assert await fetcher.fetch(server.url("/hop/2")) == PNG            # 3 redirects: the default limit
        error = await _refused(fetcher, server.url("/hop/3"), code="image_fetch_failed")
        assert "redirected more than 3 times" in error.message


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://example.com/a.png", "gopher://example.com/",
                                 "javascript:alert(1)", "FILE:///etc/passwd", "//example.com/a.png"])
async def test_schemes_other_than_http_https_and_data_are_refused(fetcher, url):
    await _refused(fetcher, url)


async def test_a_redirect_to_a_file_or_data_url_is_refused(fetcher):
    async def to_file(request):
        raise web.HTTPFound("file:///etc/passwd")

    async def to_data(request):
        raise web.HTTPFound("data:image/png;base64,iVBORw0KGgo=")

    async with serve_for_tests({"/file": to_file, "/data": to_data}) as server:
        await _refused(fetcher, server.url("/file"))
        await _refused(fetcher, server.url("/data"))
