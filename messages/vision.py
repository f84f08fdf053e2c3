"""Prefill side <-> the vision pool (services/vision_balancer/, services/vision_worker/).

DeepSeek's rule: each machine is a group; the prefill side picks a group at random and calls its leader
(the vision balancer) with VisionEncode; the leader answers VisionAccepted and gives each image to
the group's vision worker with the fewest queued patches, forwarding VisionEncode (one way, the
images it chose for that worker, `indexes` saying which ones they are); the worker encodes and
sends each image's span embeddings straight to `reply_to` (the prefill or unified worker that runs
the request), never through the gateway or the leader:

    prefill worker --VisionEncode (call)--> balancer --VisionAccepted-->  prefill worker
                                            balancer --VisionEncode-->    vision worker
    vision worker  --VisionEncoded | VisionFailed (one per image)-->      prefill worker (reply_to)
    vision worker  --VisionDone (one per job)-->                          balancer (its accounting)
    prefill worker --VisionCancel-->  balancer --VisionCancel-->          vision worker

The request id travels in the envelope header. Image bytes travel as buffer frames, never inside
the MessagePack header (whose limit is 8 MiB; an image may be larger): image i's encoded bytes are
frame i (uint8), and `ImageInput.data` is empty on the wire (`image_frames` / `images_from`).
VisionEncoded's frame 0 is the span's rows [grid.tokens, hidden] in the encoder's dtype (bfloat16
travels as a (TensorDesc, buffer) pair). A VisionFailed code is a messages.errors.ErrorCode.
"""
from __future__ import annotations

from messages.envelope import Envelope
from messages.errors import MalformedFrame
from messages.images import ImageInput, join_image_data, split_image_data
from messages.registry import Message, register


@register(0x0801)
class VisionEncode(Message):
    images: list[ImageInput]     # `data` empty on the wire: image i's bytes are buffer frame i
    reply_to: str                # the address VisionEncoded / VisionFailed go to
    indexes: list[int] = []      # each image's position in the request (empty: 0..len(images)-1)
    job: str = ""                # the leader's id of this share of the request (leader -> worker only)
    attempt: int = 0             # the caller's attempt (it retries once): echoed in every answer


@register(0x0802)
class VisionAccepted(Message):
    """The leader's answer to VisionEncode: the images are queued on these workers (instances)."""

    workers: list[str] = []


@register(0x0803)
class VisionEncoded(Message):
    """One image's span embeddings: frame 0, [grid.tokens, hidden]."""

    index: int                   # the image's position in the request
    digest: bytes                # ImageInput.digest of the image encoded (the receiver checks it)
    encode_ms: float = 0.0       # the encoder's time for the batch that held it
    attempt: int = 0             # VisionEncode.attempt


@register(0x0804)
class VisionFailed(Message):
    index: int                   # the image's position in the request
    code: int                    # messages.errors.ErrorCode (INVALID_REQUEST: undecodable or mismatched image)
    message: str
    attempt: int = 0             # VisionEncode.attempt: a caller that moved on ignores an older attempt's failures


@register(0x0805)
class VisionDone(Message):
    """Worker -> its leader: a job ended (every image sent, failed or cancelled); its patches leave the queue."""

    job: str
    patches: int                 # the job's patches (what the leader counted for it)
    encoded: int = 0
    failed: int = 0
    cancelled: int = 0


@register(0x0806)
class VisionCancel(Message):
    """The request was aborted or its caller gave up: drop its images not yet encoded."""

    job: str = ""                # leader -> worker: that job; empty: every job of the envelope's request


def positions(msg: VisionEncode) -> list[int]:
    """Each image's position in the request."""
    return list(msg.indexes) if msg.indexes else list(range(len(msg.images)))


def image_frames(images: list[ImageInput]) -> tuple[list[ImageInput], list]:
    """The images without their bytes (for the message body) and their bytes as buffer frames."""
    return split_image_data(images)


def images_from(envelope: Envelope) -> list[ImageInput]:
    """A received VisionEncode's images with their bytes put back (zero-copy views of the frames);
    MalformedFrame if the frames do not match the images."""
    msg = envelope.message
    if len(envelope.buffers) != len(msg.images):
        raise MalformedFrame(f"{len(msg.images)} images came with {len(envelope.buffers)} frames",
                             request_id=envelope.request_id)
    if msg.indexes and len(msg.indexes) != len(msg.images):
        raise MalformedFrame(f"{len(msg.images)} images came with {len(msg.indexes)} indexes",
                             request_id=envelope.request_id)
    return join_image_data(list(msg.images), envelope)


def forwarded_frames(envelope: Envelope, picks: list[int]) -> list:
    """The frames of the images at `picks` of a received VisionEncode, as they came (no copy)."""
    return [envelope.frame(i) for i in picks]
