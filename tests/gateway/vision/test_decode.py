"""inspect_image: accepted formats and sizes; corrupt, truncated and bomb images refused."""
from __future__ import annotations

import io
import struct
import zlib

import pytest
from PIL import Image

from services.gateway.vision import ImageDecodeError, ImageLimits, inspect_image
from tests.gateway.vision.conftest import image_bytes_for_tests


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_accepted_formats_report_their_size(fmt):
    assert inspect_image(image_bytes_for_tests(37, 21, fmt)) == (37, 21, fmt)


def test_an_animated_gif_is_read_as_its_first_frame():
    frames = [Image.new("P", (12, 9), i) for i in range(3)]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:])
    assert inspect_image(buffer.getvalue()) == (12, 9, "GIF")


def _code_of(data: bytes, limits: ImageLimits = ImageLimits()) -> str:
    with pytest.raises(ImageDecodeError) as caught:
        inspect_image(data, limits)
    return caught.value.code


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png_claiming(width: int, height: int) -> bytes:
    """A few dozen bytes whose header claims width x height RGB pixels."""
    header = _png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    return b"\x89PNG\r\n\x1a\n" + header + _png_chunk(b"IDAT", zlib.compress(b"\0" * 64)) + _png_chunk(b"IEND", b"")


def test_a_decompression_bomb_header_is_refused_before_decoding():
    assert _code_of(_png_claiming(100_000, 100_000)) == "image_too_large"       # Pillow's own guard
    assert _code_of(_png_claiming(8_000, 7_000)) == "image_too_large"           # ours: 56 MP > 50 MP
    assert _code_of(image_bytes_for_tests(50, 50), ImageLimits(max_pixels=2499)) == "image_too_large"


def test_a_corrupt_png_is_refused():
    png = bytearray(image_bytes_for_tests(64, 64))
    idat = png.index(b"IDAT")
    png[idat + 8: idat + 16] = b"\xff" * 8               # scrambles the compressed pixels (and the CRC)
    assert _code_of(bytes(png)) == "invalid_image"
    assert _code_of(_png_claiming(64, 64)) == "invalid_image"   # too little pixel data for its header


def test_a_truncated_jpeg_is_refused():
    jpeg = image_bytes_for_tests(64, 64, "JPEG")
    assert _code_of(jpeg[: len(jpeg) // 2]) == "invalid_image"


@pytest.mark.parametrize("data", [b"", b"hello, not an image", b"\x89PNG\r\n\x1a\n", b"GIF89a" + b"\0" * 7,
                                  b"<svg xmlns='http://www.w3.org/2000/svg'/>"])
def test_non_images_are_refused(data):
    assert _code_of(data) == "invalid_image"


def test_formats_outside_the_accepted_set_are_refused():
    assert _code_of(image_bytes_for_tests(8, 8, "TIFF")) == "invalid_image"
    assert _code_of(image_bytes_for_tests(8, 8, "ICO")) == "invalid_image"
