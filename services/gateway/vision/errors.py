"""Typed errors for a client's image: each becomes a 400 naming `code` and the image's `path`."""
from __future__ import annotations

FORBIDDEN = "image_url_forbidden"        # a scheme or destination address the gateway will not fetch
TOO_LARGE = "image_too_large"            # bytes, pixels or image tokens over a limit
TIMEOUT = "image_fetch_timeout"
FETCH_FAILED = "image_fetch_failed"      # HTTP status, connection refused, unresolvable name, redirect loop
INVALID_URL = "invalid_image_url"        # unparsable URL, bad data URL, non-image media type
INVALID_IMAGE = "invalid_image"          # not a PNG/JPEG/WebP/GIF/BMP, corrupt or truncated
TOO_MANY = "too_many_images"


class ImageInputError(Exception):
    """A client's image cannot be used. `path` locates it in the request (`messages[0].content[1]`)."""

    def __init__(self, code: str, message: str, path: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.path = path

    def at(self, path: str) -> "ImageInputError":
        """This error, located at `path` (kept if it already has one)."""
        if not self.path:
            self.path = path
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code!r}, {self.message!r}, path={self.path!r})"


class ImageFetchError(ImageInputError):
    """The image's bytes could not be obtained (URL, address, size, time, HTTP)."""


class ImageDecodeError(ImageInputError):
    """The bytes are not an image we accept, or too many pixels."""
