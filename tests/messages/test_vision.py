"""The vision pool's messages: image bytes travel as frames beside a bare body (never inside the
8 MiB header), come back as views of those frames, and frames that do not match the images are
MalformedFrame; the tags sit in the vision block (0x08xx)."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from messages import Codec, tag_of
from messages.errors import MalformedFrame
from messages.images import ImageInput, plan_image_grid
from messages.tensors import TensorDesc
from messages.vision import (VisionAccepted, VisionCancel, VisionDone, VisionEncode, VisionEncoded, VisionFailed,
                             forwarded_frames, image_frames, images_from, positions)


def image(size: int, data: bytes) -> ImageInput:
    return ImageInput(hashlib.sha256(data).digest(), data, size, size, plan_image_grid(size, size), start=3)


def round_trip(message, buffers=()):
    return Codec().decode([bytearray(f) for f in Codec().encode(message, request_id="r1", buffers=buffers)])


def test_the_vision_block_of_tags():
    types = (VisionEncode, VisionAccepted, VisionEncoded, VisionFailed, VisionDone, VisionCancel)
    assert [tag_of(t) for t in types] == list(range(0x0801, 0x0807))


def test_image_bytes_travel_as_frames_not_in_the_header():
    big = bytes(range(256)) * 40000   # ~10 MB: over the header limit
    images = [image(600, b"png-bytes"), image(900, big)]
    bare, frames = image_frames(images)
    assert all(img.data == b"" for img in bare)
    envelope = round_trip(VisionEncode(bare, "tcp://prefill-0:5601", indexes=[4, 2]), frames)
    got = images_from(envelope)
    assert [bytes(g.data) for g in got] == [b"png-bytes", big] and isinstance(got[1].data, memoryview)
    assert [(g.digest, g.grid, g.start) for g in got] == [(i.digest, i.grid, i.start) for i in images]
    assert positions(envelope.message) == [4, 2] and positions(VisionEncode(bare, "x")) == [0, 1]
    assert [desc for desc, _ in forwarded_frames(envelope, [1])] == [TensorDesc("uint8", (len(big),))]


def test_frames_that_do_not_match_the_images_are_malformed():
    bare, frames = image_frames([image(600, b"a"), image(600, b"b")])
    with pytest.raises(MalformedFrame, match="2 images came with 1 frames"):
        images_from(round_trip(VisionEncode(bare, "x"), frames[:1]))
    with pytest.raises(MalformedFrame, match="2 images came with 1 indexes"):
        images_from(round_trip(VisionEncode(bare, "x", indexes=[0]), frames))
    with pytest.raises(MalformedFrame, match="not bytes"):
        images_from(round_trip(VisionEncode(bare, "x"), [frames[0], np.zeros(2, dtype=np.float32)]))
