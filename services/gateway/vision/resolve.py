"""A request's images, from sources to `ImageInput`s: fetch, decode, digest, plan the grid.

Fetches run concurrently; decoding and hashing run in an executor, off the event loop. The first
image to fail is the error, located at its `path` (among failures seen together, the earliest in
the request); the others are cancelled rather than finished, since the request is refused anyway.
"""
from __future__ import annotations

import asyncio
import hashlib
from concurrent.futures import Executor
from typing import Sequence

from messages.images import ImageInput, ImageTooLarge, VisionSizing, plan_image_grid
from services.gateway.vision.decode import inspect_image
from services.gateway.vision.errors import TOO_LARGE, TOO_MANY, ImageInputError
from services.gateway.vision.fetch import ImageFetcher
from services.gateway.vision.limits import ImageLimits

# (kind, value, path): kind "url" (http, https or data URL, value str) or "bytes" (value bytes);
# path locates the image in the request, e.g. "messages[0].content[1]".
ImageSourceRef = tuple[str, "str | bytes", str]


class ImageResolver:
    def __init__(self, fetcher: ImageFetcher, sizing: VisionSizing,
                 limits: ImageLimits | None = None, executor: Executor | None = None) -> None:
        self.fetcher = fetcher
        self.sizing = sizing
        self.limits = limits or fetcher.limits
        self._executor = executor    # None: the loop's default executor

    async def resolve(self, sources: Sequence[ImageSourceRef]) -> list[ImageInput]:
        """One ImageInput per source, in order (`start` left for the caller); raises ImageInputError."""
        if len(sources) > self.limits.max_images:
            raise ImageInputError(TOO_MANY, f"the request has {len(sources)} images; the limit is "
                                            f"{self.limits.max_images}", sources[self.limits.max_images][2])
        budget = _ByteBudget(self.limits.max_total_bytes)
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._one(source, budget)) for source in sources]
        except ExceptionGroup as failed:
            errors = [error for error in failed.exceptions if isinstance(error, ImageInputError)]
            if len(errors) < len(failed.exceptions):
                raise
            order = [path for _, _, path in sources]
            raise min(errors, key=lambda error: order.index(error.path)) from None
        return [task.result() for task in tasks]

    async def _one(self, source: ImageSourceRef, budget: "_ByteBudget") -> ImageInput:
        kind, value, path = source
        try:
            data = await self._bytes_of(kind, value)
            budget.take(len(data))
            loop = asyncio.get_running_loop()
            width, height, digest = await loop.run_in_executor(self._executor, _inspect_and_digest,
                                                               data, self.limits)
            grid = plan_image_grid(width, height, self.sizing)
        except ImageTooLarge as exc:
            raise ImageInputError(TOO_LARGE, str(exc), path) from None
        except ImageInputError as exc:
            raise exc.at(path) from None
        return ImageInput(digest=digest, data=data, width=width, height=height, grid=grid)

    async def _bytes_of(self, kind: str, value) -> bytes:
        if kind == "url" and isinstance(value, str):
            return await self.fetcher.fetch(value)
        if kind == "bytes" and isinstance(value, (bytes, bytearray, memoryview)):
            if len(value) > self.limits.max_bytes:
                raise ImageInputError(TOO_LARGE, f"the image is {len(value)} bytes; the limit is "
                                                 f"{self.limits.max_bytes}")
            return bytes(value)
        raise TypeError(f"an image source is ('url', str, path) or ('bytes', bytes, path), not {kind!r}")


def _inspect_and_digest(data: bytes, limits: ImageLimits) -> tuple[int, int, bytes]:
    width, height, _format = inspect_image(data, limits)
    return width, height, hashlib.sha256(data).digest()


class _ByteBudget:
    """The request's images together stay under `limit` bytes (one event loop: no lock)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, size: int) -> None:
        self.used += size
        if self.used > self.limit:
            raise ImageInputError(TOO_LARGE, f"the request's images total more than {self.limit} bytes")
