"""The images of a converted conversation, as `ImageResolver` sources.

What deepseek-recipe 0.2.0 gives (`message.image_sources`, every message, in request order):
- OpenAI chat `image_url` with a data URL, Responses `input_image` with a data URL and Anthropic
  `image` with a base64 source: a DataUrlImageSource, kind "data_url", `.data_url` set (Anthropic's
  rebuilt as `data:<media_type>;base64,<data>`). Bad base64, non-image media types and schemes
  other than http(s)/data are already conversion errors there.
- http(s) URLs in all three APIs: a UrlImageSource, kind "url", `.url` as the client wrote it.
- kind "bytes" (`.data`) only for hand-built sources; conversion never makes one.
- `.path` is coarse and spelled per API: chat `.messages[1]` (no part index), Responses `input[0]`,
  Anthropic `messages.0.content[1]`. `image_part_paths` finds the exact part in the body instead;
  `detail` other than high/auto is refused by the adapter (prepare.py: V4.1's rule has no low mode).
"""
from __future__ import annotations

import re
from typing import Sequence

from services.gateway.adapter.images import IMAGE_PARTS, part_paths
from services.gateway.vision.resolve import ImageSourceRef

_DOTTED_INDEX = re.compile(r"\.(\d+)")


def sources_of(conversation, part_paths: Sequence[str] | None = None) -> list[ImageSourceRef]:
    """(kind, value, path) for every image of `conversation`. `part_paths` (from
    `image_part_paths`) name each image exactly when they match the recipe's count."""
    images = [source for message in conversation.messages for source in message.image_sources]
    exact = part_paths is not None and len(part_paths) == len(images)
    refs: list[ImageSourceRef] = []
    for i, source in enumerate(images):
        path = part_paths[i] if exact else _readable(source.path)
        if source.kind == "bytes":
            refs.append(("bytes", source.data, path))
        elif source.kind == "data_url":
            refs.append(("url", source.data_url, path))
        else:
            refs.append(("url", source.url, path))
    return refs


def image_part_paths(messages, path: str) -> list[str]:
    """Where every image part of a request's message list is (`messages[0].content[1]`), in order."""
    return part_paths(messages, path, IMAGE_PARTS)


def _readable(recipe_path: str) -> str:
    """`.messages[1]` -> `messages[1]`, `messages.0.content[1]` -> `messages[0].content[1]`."""
    return _DOTTED_INDEX.sub(r"[\1]", recipe_path.lstrip("."))
