"""A request's images at the worker that prefills it: which need encoding, and their rows.

The gateway sends each image's bytes as a buffer frame (messages/images.py); the worker asks the
vision pool (vision_client.py: a random group) for the span embeddings of every image its
engine may have to compute. A prefix hit H is computed from H - 128 at the earliest (V4.1 bounded
replay replays the hit's last block), so an image ending at or before that needs no encoding: its
blocks come from the store. What the engine is given covers everything after `from_position`; a hit
that turns out shorter than expected fails the request in the engine rather than guessing
(engine/scheduler: no image token is ever computed without its embeddings).
"""
from __future__ import annotations

import asyncio

from messages.images import ImageInput, join_image_data
from messages.prefix import BLOCK_TOKENS
from services.workers.vision_client import VisionClient

REPLAY_TOKENS = BLOCK_TOKENS   # a bounded-replay hit recomputes its last block


def first_computed(hit_tokens: int) -> int:
    """The lowest position an engine computes after a prefix hit of `hit_tokens`."""
    return max(0, hit_tokens // BLOCK_TOKENS * BLOCK_TOKENS - REPLAY_TOKENS)


class ImageRows:
    def __init__(self, service, timeout_s: float):
        self.service = service
        self.client = VisionClient(service, timeout_s=timeout_s)

    def handlers(self) -> dict:
        return self.client.handlers()

    @staticmethod
    def images_of(request, envelope) -> list[ImageInput]:
        """The request's images with their bytes (frames 0..n-1 of the envelope that carried it)."""
        return join_image_data(list(request.images), envelope) if request.images else []

    def start(self, request_id: str, images: list[ImageInput], groups: list[str], from_position: int,
              span=None) -> asyncio.Future | None:
        """Encode the images ending after `from_position`; the future gives one entry per image
        (rows, or None for an image left to the prefix cache). None when there is nothing to encode."""
        wanted = [i for i, image in enumerate(images) if image.end > from_position]
        if not wanted:
            return None
        return asyncio.ensure_future(self._rows(request_id, images, wanted, groups, span))

    async def _rows(self, request_id, images, wanted, groups, span) -> list:
        rows = await self.client.encode(request_id, [images[i] for i in wanted], groups, span)
        out: list = [None] * len(images)
        for i, r in zip(wanted, rows):
            out[i] = r
        return out

    async def more(self, request_id: str, images: list[ImageInput], rows: list, groups: list[str],
                   from_position: int, span=None) -> list:
        """`rows` completed down to `from_position` (a prefix load that gave less than the router expected)."""
        wanted = [i for i, image in enumerate(images) if image.end > from_position and rows[i] is None]
        if wanted:
            extra = await self.client.encode(request_id, [images[i] for i in wanted], groups, span)
            for i, r in zip(wanted, extra):
                rows[i] = r
        return rows

    def cancel(self, request_id: str) -> None:
        self.client.cancel(request_id)
