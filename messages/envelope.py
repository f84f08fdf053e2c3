"""Frames on the wire: `[type tag (2 bytes, big-endian), header (MessagePack), *buffers]`.

The header carries routing and tracing facts common to every message plus the message body
(kept as raw MessagePack until the type is known) and a TensorDesc for each buffer frame.
Decoding is strict: anything but a well-formed frame set of a known type and our schema
version raises a WireError subclass, never anything else.
"""
from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field

import msgspec

from messages.errors import (FrameTooLarge, MalformedFrame, SchemaVersionMismatch,
                             UnknownMessageType)
from messages.registry import Message, tag_of, type_of
from messages.tensors import TensorDesc, check, describe

SCHEMA_VERSION = 2   # 2: PrefillWork, SwaFetch changed; DecodePick/DecodeChoice retired


class Header(msgspec.Struct, array_like=True, gc=False):
    version: int
    msg_id: str
    request_id: str
    traceparent: str   # W3C trace context: 00-<trace id>-<span id>-<flags>
    sender: str        # instance name of the sending service
    sent_at: float     # sender's wall clock, seconds since the epoch
    tensors: list[TensorDesc]
    body: msgspec.Raw
    in_reply_to: str = ""   # msg_id of the request this answers (request/reply calls)


@dataclass(frozen=True)
class WireLimits:
    max_frames: int = 4096
    max_header_bytes: int = 8 << 20
    max_buffer_bytes: int = 4 << 30
    max_total_bytes: int = 16 << 30


@dataclass
class Envelope:
    """A decoded message with its header and its buffer frames (still zero-copy)."""

    message: Message
    header: Header
    buffers: list = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.header.request_id

    def frame(self, index: int) -> tuple[TensorDesc, memoryview]:
        """Buffer frame `index` with its descriptor (checked at decode), as a byte view (no copy).
        A message names its frames by index: a bad index is the sender's fault, hence MalformedFrame."""
        if not 0 <= index < len(self.buffers):
            raise MalformedFrame(f"message refers to tensor {index}, only {len(self.buffers)} travelled")
        buf = self.buffers[index]
        return self.header.tensors[index], buf if type(buf) is memoryview else memoryview(buf)


_IDS = random.Random()   # private: reseeded in forked children below; the global random stays untouched
os.register_at_fork(after_in_child=_IDS.seed)


def random_hex(bits: int) -> str:
    """Random bits as hex digits from a private PRNG: ids need uniqueness, not secrecy, and a
    getrandom syscall per message (os.urandom) is measurable."""
    return f"{_IDS.getrandbits(bits):0{bits // 4}x}"


def new_msg_id() -> str:
    return random_hex(64)


def _nbytes(frame) -> int:
    if isinstance(frame, (bytes, bytearray)):
        return len(frame)
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    return memoryview(buf if buf is not None else frame).nbytes


def _as_view(frame):
    buf = getattr(frame, "buffer", None)
    return buf if buf is not None else frame


class Codec:
    """Encodes and decodes envelopes. Build one per process (or per service) and reuse it: it keeps
    the encoder, the decoders and the tag frames of the types it has seen."""

    def __init__(self, sender: str = "", limits: WireLimits = WireLimits()):
        self.sender = sender
        self.limits = limits
        self._encoder = msgspec.msgpack.Encoder()
        self._header_decoder = msgspec.msgpack.Decoder(Header)
        self._body_decoders: dict[type, msgspec.msgpack.Decoder] = {}
        self._tag_frames: dict[type, bytes] = {}    # message type -> its 2-byte tag frame
        self._types: dict[bytes, type] = {}         # tag frame -> message type (known tags only)

    def encode(self, message: Message, *, request_id: str = "", traceparent: str = "",
               buffers=(), msg_id: str = "", in_reply_to: str = "") -> list:
        """Frames ready for `send_multipart(..., copy=False)`; buffers are not copied."""
        cls = type(message)
        tag_frame = self._tag_frames.get(cls)
        if tag_frame is None:
            tag_frame = self._tag_frames[cls] = tag_of(cls).to_bytes(2, "big")
        encode = self._encoder.encode
        descs, frames = [], [tag_frame, b""]
        for buf in buffers:
            desc, view = describe(buf)
            descs.append(desc)
            frames.append(view)
        frames[1] = encode(Header(SCHEMA_VERSION, msg_id or new_msg_id(), request_id, traceparent, self.sender,
                                  time.time(), descs, msgspec.Raw(encode(message)), in_reply_to))
        return frames

    def decode(self, frames) -> Envelope:
        """Frames (bytes, memoryviews or zmq.Frame) -> Envelope, or a WireError."""
        lim = self.limits
        if len(frames) < 2:
            raise MalformedFrame(f"expected at least 2 frames (tag, header), got {len(frames)}")
        if len(frames) > lim.max_frames:
            raise FrameTooLarge(f"{len(frames)} frames exceed the limit of {lim.max_frames}")
        tag_frame = frames[0]
        if type(tag_frame) is not bytes:
            tag_frame = bytes(_as_view(tag_frame))
        cls = self._types.get(tag_frame)
        if cls is None:
            if len(tag_frame) != 2:
                raise MalformedFrame(f"type tag must be 2 bytes, got {len(tag_frame)}")
            tag = int.from_bytes(tag_frame, "big")
            cls = type_of(tag)
            if cls is None:
                raise UnknownMessageType(f"unknown message type tag {tag:#06x}")
            self._types[tag_frame] = cls
        header_frame = frames[1]
        if type(header_frame) is bytes:
            header_size = len(header_frame)
        else:
            header_frame = _as_view(header_frame)
            header_size = _nbytes(header_frame)
        if header_size > lim.max_header_bytes:
            raise FrameTooLarge(f"header of {header_size} bytes exceeds {lim.max_header_bytes}")
        try:
            header = self._header_decoder.decode(header_frame)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:  # nesting too deep
            raise MalformedFrame(f"bad header: {exc}") from None
        if header.version != SCHEMA_VERSION:
            raise SchemaVersionMismatch(
                f"schema version {header.version}, this process speaks {SCHEMA_VERSION}",
                request_id=header.request_id)
        buffers = [_as_view(f) for f in frames[2:]] if len(frames) > 2 else []
        if len(buffers) != len(header.tensors):
            raise MalformedFrame(f"header describes {len(header.tensors)} buffers, {len(buffers)} arrived",
                                 request_id=header.request_id)
        total = header_size
        for desc, buf in zip(header.tensors, buffers):
            size = _nbytes(buf)
            if size > lim.max_buffer_bytes:
                raise FrameTooLarge(f"buffer of {size} bytes exceeds {lim.max_buffer_bytes}")
            total += size
            check(desc, size)
        if total > lim.max_total_bytes:
            raise FrameTooLarge(f"message of {total} bytes exceeds {lim.max_total_bytes}")
        decoder = self._body_decoders.get(cls)
        if decoder is None:
            decoder = self._body_decoders[cls] = msgspec.msgpack.Decoder(cls)
        try:
            message = decoder.decode(header.body)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            raise MalformedFrame(f"bad {cls.__name__} body: {exc}", request_id=header.request_id) from None
        return Envelope(message, header, buffers)
