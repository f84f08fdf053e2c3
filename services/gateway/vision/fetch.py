"""An SSRF-safe image fetcher on aiohttp: http(s) and data: URLs, public addresses only.

- Schemes: http, https and data; everything else (file:, ftp:, gopher:...) is refused.
- Addresses: literal IP hosts are checked here; names are resolved by `CheckedResolver` inside the
  connector, so only checked addresses are connected to (no DNS-rebinding window; no DNS cache).
- Redirects are followed by hand (at most `max_redirects`), each hop checked again.
- Limits: one deadline for the whole fetch, a connect timeout, bytes (Content-Length and while
  streaming), data URL size; no proxy or cookies from the environment or from other clients.
"""
from __future__ import annotations

import asyncio

import aiohttp
from aiohttp.abc import AbstractResolver
from yarl import URL

from services.gateway.vision.addresses import AddressPolicy, CheckedResolver
from services.gateway.vision.data_url import decode_data_url, is_data_url
from services.gateway.vision.errors import (
    FETCH_FAILED, FORBIDDEN, INVALID_URL, TIMEOUT, TOO_LARGE, ImageFetchError,
)
from services.gateway.vision.limits import ImageLimits

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_SCHEMES = frozenset({"http", "https"})
_HEADERS = {"Accept": "image/*", "Accept-Encoding": "identity", "User-Agent": "epd-image-fetcher"}
_CHUNK = 64 << 10


class ImageFetcher:
    """One per gateway process: a shared ClientSession (made on first use), closed by `close()`.
    `resolver` replaces the system resolver underneath the address check (tests simulate DNS)."""

    def __init__(self, limits: ImageLimits = ImageLimits(),
                 resolver: AbstractResolver | None = None) -> None:
        self.limits = limits
        self.policy = AddressPolicy(limits.networks())
        self._resolver = resolver
        self._session: aiohttp.ClientSession | None = None
        self._checked_resolver: CheckedResolver | None = None
        self._slots = asyncio.Semaphore(limits.max_concurrent_fetches)

    async def fetch(self, url: str) -> bytes:
        """The bytes at `url`; raises ImageFetchError."""
        if is_data_url(url):
            return decode_data_url(url, self.limits)
        target = self._checked_url(url, what="image URL")
        async with self._slots:
            try:
                async with asyncio.timeout(self.limits.total_timeout_s):
                    return await self._follow(target)
            except TimeoutError:
                raise ImageFetchError(TIMEOUT, f"fetching the image took longer than "
                                               f"{self.limits.total_timeout_s:g} s") from None

    async def close(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()
            await self._checked_resolver.close()   # the connector closes only resolvers it made

    async def __aenter__(self) -> "ImageFetcher":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    # -- one fetch ----------------------------------------------------------------------------

    async def _follow(self, url: URL) -> bytes:
        session = self._open_session()
        for _ in range(self.limits.max_redirects + 1):
            try:
                async with session.get(url, allow_redirects=False, headers=_HEADERS) as response:
                    if response.status in _REDIRECTS:
                        url = self._redirect_target(url, response.headers.get("Location"))
                        continue
                    if not 200 <= response.status < 300:
                        raise ImageFetchError(FETCH_FAILED, f"the image URL answered HTTP {response.status}")
                    return await self._read_body(response)
            except TimeoutError:     # aiohttp's connect timeout (the total deadline cancels instead)
                raise ImageFetchError(TIMEOUT, f"connecting to the image host took longer than "
                                               f"{self.limits.connect_timeout_s:g} s") from None
            except aiohttp.InvalidURL as exc:
                raise ImageFetchError(INVALID_URL, f"invalid image URL: {exc}") from None
            except aiohttp.ClientError as exc:
                raise ImageFetchError(FETCH_FAILED, f"fetching the image failed: {exc}") from None
        raise ImageFetchError(FETCH_FAILED, f"the image URL redirected more than "
                                            f"{self.limits.max_redirects} times")

    async def _read_body(self, response: aiohttp.ClientResponse) -> bytes:
        limit = self.limits.max_bytes
        if response.content_length is not None and response.content_length > limit:
            raise ImageFetchError(TOO_LARGE, f"the image is {response.content_length} bytes; "
                                             f"the limit is {limit}")
        body = bytearray()
        async for chunk in response.content.iter_chunked(_CHUNK):
            body += chunk
            if len(body) > limit:
                raise ImageFetchError(TOO_LARGE, f"the image is over the limit of {limit} bytes")
        return bytes(body)

    def _redirect_target(self, current: URL, location: str | None) -> URL:
        if not location:
            raise ImageFetchError(FETCH_FAILED, "the image URL redirected without a Location")
        try:
            target = current.join(URL(location))
        except (ValueError, TypeError):
            raise ImageFetchError(FETCH_FAILED, "the image URL redirected to an invalid URL") from None
        return self._checked_url(str(target), what="redirect target")

    def _checked_url(self, url: str, what: str) -> URL:
        """An http(s) URL with a host, whose literal IP (if any) is allowed."""
        try:
            parsed = URL(url)
        except (ValueError, TypeError):
            raise ImageFetchError(INVALID_URL, f"the {what} is not a valid URL") from None
        scheme = parsed.scheme.lower()
        if scheme not in _SCHEMES:
            raise ImageFetchError(FORBIDDEN, f"the {what}'s scheme {scheme or '(none)'}: is not "
                                             f"allowed; use http, https or data")
        if not parsed.raw_host:
            raise ImageFetchError(INVALID_URL, f"the {what} has no host")
        self.policy.check_host(parsed.raw_host)
        return parsed.with_fragment(None)

    def _open_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            inner = self._resolver or aiohttp.ThreadedResolver()
            self._checked_resolver = CheckedResolver(self.policy, inner)
            connector = aiohttp.TCPConnector(
                resolver=self._checked_resolver, use_dns_cache=False,
                limit=self.limits.max_concurrent_fetches)
            self._session = aiohttp.ClientSession(
                connector=connector, trust_env=False, cookie_jar=aiohttp.DummyCookieJar(),
                timeout=aiohttp.ClientTimeout(total=None, connect=self.limits.connect_timeout_s))
        return self._session
