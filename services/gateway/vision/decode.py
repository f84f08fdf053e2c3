"""Checking that bytes are an image we accept, and its size, before any service relies on it.

Synchronous and pure: the resolver runs it in an executor (Pillow releases the GIL while decoding).
The header's size is checked before decoding, so a small file claiming 100000 x 100000 pixels
(a decompression bomb) costs nothing; a full `load()` then rejects truncated and corrupt data here,
as a 400, rather than in the vision worker.
"""
from __future__ import annotations

import io

from PIL import Image

from services.gateway.vision.errors import INVALID_IMAGE, TOO_LARGE, ImageDecodeError
from services.gateway.vision.limits import ImageLimits

ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")   # GIF and WebP: the first frame


def inspect_image(data: bytes, limits: ImageLimits = ImageLimits()) -> tuple[int, int, str]:
    """(width, height, format) of an accepted, fully decodable image; raises ImageDecodeError."""
    try:
        with Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS) as image:
            width, height = image.size
            if width * height > limits.max_pixels:
                raise ImageDecodeError(TOO_LARGE, f"the image is {width}x{height} pixels; the limit is "
                                                  f"{limits.max_pixels} pixels")
            if width <= 0 or height <= 0:
                raise ImageDecodeError(INVALID_IMAGE, f"the image has no pixels ({width}x{height})")
            image.load()
            return width, height, image.format
    except ImageDecodeError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        # Pillow's own guard, in open(), for headers past its MAX_IMAGE_PIXELS (a warning, or an
        # error past twice that): far over any sane max_pixels
        raise ImageDecodeError(TOO_LARGE, f"the image has more than {limits.max_pixels} pixels") from None
    except Image.UnidentifiedImageError:
        raise ImageDecodeError(INVALID_IMAGE, "the image is not PNG, JPEG, WebP, GIF or BMP") from None
    except Exception as exc:  # noqa: BLE001 - Pillow's decoders raise many types on hostile input
        raise ImageDecodeError(INVALID_IMAGE, f"the image cannot be decoded "
                                              f"({type(exc).__name__}: {exc})") from None
