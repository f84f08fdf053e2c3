"""`data:` URLs (RFC 2397): the image's bytes inline, base64 or percent-encoded."""
from __future__ import annotations

import base64
import binascii
import re
from urllib.parse import unquote_to_bytes

from services.gateway.vision.errors import INVALID_URL, TOO_LARGE, ImageFetchError
from services.gateway.vision.limits import ImageLimits

_WHITESPACE = re.compile(r"[\t\n\f\r ]+")


def is_data_url(url: str) -> bool:
    return url[:5].lower() == "data:"


def decode_data_url(url: str, limits: ImageLimits) -> bytes:
    """The bytes of an image data URL; raises ImageFetchError (invalid_image_url, image_too_large)."""
    if len(url) > limits.max_data_url_chars:
        raise ImageFetchError(TOO_LARGE, f"the data URL is {len(url)} characters; the limit is "
                                         f"{limits.max_data_url_chars}")
    header, comma, body = url[5:].partition(",")
    if not comma:
        raise ImageFetchError(INVALID_URL, "a data URL needs a ',' before its data")
    params = [param.strip().lower() for param in header.split(";")]
    media_type = params[0] or "text/plain"
    if not media_type.startswith("image/"):
        raise ImageFetchError(INVALID_URL, f"the data URL's media type is {media_type}, not an image")
    if len(params) > 1 and params[-1] == "base64":
        data = _base64(body)
    else:
        data = unquote_to_bytes(body)
    if not data:
        raise ImageFetchError(INVALID_URL, "the data URL has no data")
    if len(data) > limits.max_bytes:
        raise ImageFetchError(TOO_LARGE, f"the image is {len(data)} bytes; the limit is {limits.max_bytes}")
    return data


def _base64(body: str) -> bytes:
    text = _WHITESPACE.sub("", unquote_to_bytes(body).decode("latin-1") if "%" in body else body)
    text += "=" * (-len(text) % 4)    # clients often drop the padding
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ImageFetchError(INVALID_URL, "the data URL's base64 data is not valid base64") from None
