"""Hypothesis strategies for the wire contract (test-only helper).

`message_strategy(cls)` builds valid instances of any message type from its msgspec fields;
`encoded_messages()` gives valid frame lists of every registered type with random buffers;
`mutated_frames()` damages such frame lists the ways a broken or hostile peer could.
"""
from __future__ import annotations

import math
import types
import typing
from dataclasses import dataclass

import msgspec
import numpy as np
from hypothesis import strategies as st

from messages import Codec, Message, message_types
from messages.tensors import ITEMSIZE, NUMPY_NATIVE, TensorDesc

INT_MIN, UINT_MAX = -(2**63), 2**64 - 1   # what a MessagePack integer can hold
TEST_TAGS = 0xF000                        # tests may register their own types from here on

WIRE_DTYPES = list(ITEMSIZE)             # every dtype that may travel, by wire name
NUMPY_DTYPES = sorted(NUMPY_NATIVE)       # those with a numpy dtype (the others travel as pairs)


def catalogue() -> dict[int, type[Message]]:
    """The production message types, tag -> type (types tests registered are left out)."""
    return {tag: cls for tag, cls in sorted(message_types().items()) if tag < TEST_TAGS}


# ---- valid messages -------------------------------------------------------------------------

wire_ints = st.integers(INT_MIN, UINT_MAX)
wire_floats = st.floats(allow_nan=False)   # NaN != NaN would defeat equality checks


def strategy_for(tp) -> st.SearchStrategy:
    """Values of a field type that MessagePack can carry. st.from_type is used where its values
    fit the wire (str, bytes, bool); ints are bounded to 64 bits and floats kept NaN-free."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is int:
        return wire_ints
    if tp is float:
        return wire_floats
    if tp is type(None):
        return st.none()
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return struct_strategy(tp)
    if origin is list:
        return st.lists(strategy_for(args[0]), max_size=4)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return st.lists(strategy_for(args[0]), max_size=4).map(tuple)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(strategy_for(arg) for arg in args))
    return st.from_type(tp)


def struct_strategy(cls: type[msgspec.Struct]) -> st.SearchStrategy:
    """Instances of a Struct; fields with defaults are sometimes left to their default."""
    required, optional = {}, {}
    for f in msgspec.structs.fields(cls):
        (required if f.required else optional)[f.name] = strategy_for(f.type)
    return st.fixed_dictionaries(required, optional=optional).map(lambda kw: cls(**kw))


def message_strategy(cls: type[Message]) -> st.SearchStrategy:
    return struct_strategy(cls)


# ---- buffers --------------------------------------------------------------------------------

@st.composite
def tensor_frames(draw, dtypes=tuple(WIRE_DTYPES), max_dim=4, max_ndim=4) -> tuple[TensorDesc, memoryview]:
    """(TensorDesc, buffer) pairs with random bit patterns (NaNs, infs, odd bools included)."""
    name = draw(st.sampled_from(dtypes))
    shape = tuple(draw(st.lists(st.integers(0, max_dim), max_size=max_ndim)))
    nbytes = math.prod(shape) * ITEMSIZE[name]
    return TensorDesc(name, shape), memoryview(bytearray(draw(st.binary(min_size=nbytes, max_size=nbytes))))


def as_array(frame: tuple[TensorDesc, memoryview]) -> np.ndarray:
    desc, buf = frame
    return np.frombuffer(buf, dtype=desc.dtype).reshape(desc.shape)


def buffers() -> st.SearchStrategy:
    """Anything `Codec.encode` takes as a buffer: (TensorDesc, buffer) pairs, numpy arrays, raw bytes."""
    return st.one_of(
        tensor_frames(),
        tensor_frames(dtypes=NUMPY_DTYPES).map(as_array),
        st.binary(max_size=64),
    )


@dataclass
class Encoded:
    """A valid encoding and what went into it."""

    tag: int
    message: Message
    buffers: list
    frames: list[bytes]


@st.composite
def encoded_messages(draw, classes=None) -> Encoded:
    """Valid frames of one of `classes` (default: every registered type) with 0-3 buffers."""
    cls = draw(st.sampled_from(classes or list(catalogue().values())))
    message = draw(message_strategy(cls))
    bufs = draw(st.lists(buffers(), max_size=3))
    text = st.text(max_size=12)
    frames = Codec(sender=draw(text)).encode(
        message, request_id=draw(text), traceparent=draw(text), buffers=bufs,
        in_reply_to=draw(text))
    tag = int.from_bytes(frames[0], "big")
    return Encoded(tag, message, bufs, [bytes(f) for f in frames])


# ---- hostile input ----------------------------------------------------------------------------

def _str_with_raw_bytes(data: bytes) -> msgspec.Raw:
    """A MessagePack str whose payload may not be UTF-8."""
    return msgspec.Raw(bytes([0xA0 | len(data)]) + data)


wire_scalars = st.one_of(
    st.none(), st.booleans(), wire_ints, st.floats(), st.text(max_size=8), st.binary(max_size=8),
    st.binary(max_size=8).map(_str_with_raw_bytes),
    st.builds(msgspec.msgpack.Ext, st.integers(-128, 127), st.binary(max_size=8)),
)
wire_values = st.recursive(
    wire_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12)

huge_dims = st.sampled_from([2**31, 2**32 + 1, 2**62, 2**63 - 1, 2**63, UINT_MAX])
hostile_dims = st.one_of(st.integers(0, 8), huge_dims, st.integers(INT_MIN, -1))
hostile_descs = st.tuples(
    st.sampled_from([*WIRE_DTYPES, "complex64", "float4", "", "\u00e9", "bfloat16 "]) | st.text(max_size=6),
    st.lists(hostile_dims, max_size=10),
)

_encoder = msgspec.msgpack.Encoder()


def _generic(frame: bytes):
    """The frame decoded as untyped MessagePack, or None where it is not MessagePack."""
    try:
        return msgspec.msgpack.decode(frame)
    except (msgspec.DecodeError, RecursionError):
        return None


def _pick(draw, frames) -> int:
    return draw(st.integers(0, len(frames) - 1))


def flip_bits(draw, frames):
    i = _pick(draw, frames)
    frame = bytearray(frames[i])
    if frame:
        for pos in draw(st.lists(st.integers(0, len(frame) * 8 - 1), min_size=1, max_size=4)):
            frame[pos // 8] ^= 1 << (pos % 8)
    return [*frames[:i], bytes(frame), *frames[i + 1:]]


def truncate(draw, frames):
    i = _pick(draw, frames)
    cut = draw(st.integers(0, max(len(frames[i]) - 1, 0)))
    return [*frames[:i], frames[i][:cut], *frames[i + 1:]]


def extend(draw, frames):
    i = _pick(draw, frames)
    return [*frames[:i], frames[i] + draw(st.binary(min_size=1, max_size=16)), *frames[i + 1:]]


def drop_frame(draw, frames):
    i = _pick(draw, frames)
    return frames[:i] + frames[i + 1:]


def duplicate_frame(draw, frames):
    i, at = _pick(draw, frames), draw(st.integers(0, len(frames)))
    return [*frames[:at], frames[i], *frames[at:]]


def reorder(draw, frames):
    return draw(st.permutations(frames))


def swap_tag(draw, frames):
    tags = [tag.to_bytes(2, "big") for tag in catalogue()]
    tag = draw(st.sampled_from(tags) | st.binary(max_size=3))
    return [tag, *frames[1:]]


def random_header(draw, frames):
    """Frame 1 replaced by any MessagePack value, or by a header-length array of them."""
    if len(frames) < 2:
        return frames
    value = draw(wire_values | st.lists(wire_values, min_size=8, max_size=10))
    return [frames[0], _encoder.encode(value), *frames[2:]]


def _edit_array(draw, items: list) -> list:
    """Replace, delete or append one element of a decoded MessagePack array."""
    action = draw(st.sampled_from(["replace", "delete", "append"]))
    if action == "append" or not items:
        return [*items, draw(wire_values)]
    i = draw(st.integers(0, len(items) - 1))
    if action == "delete":
        return items[:i] + items[i + 1:]
    return [*items[:i], draw(wire_values), *items[i + 1:]]


def edit_header_field(draw, frames):
    header = _generic(frames[1]) if len(frames) >= 2 else None
    if not isinstance(header, list):
        return frames
    return [frames[0], _encoder.encode(_edit_array(draw, header)), *frames[2:]]


def _with_header_items(frames, edit):
    """Frames with the header array rewritten by `edit(items)`; unchanged if not an array."""
    header = _generic(frames[1]) if len(frames) >= 2 else None
    if not isinstance(header, list) or len(header) < 8:
        return frames
    return [frames[0], _encoder.encode(edit(list(header))), *frames[2:]]


def edit_body(draw, frames):
    """The body (header element 7) replaced, or one of its fields replaced, by random values."""
    def edit(items):
        body = items[7]
        if isinstance(body, list) and draw(st.booleans()):
            items[7] = _edit_array(draw, body)
        else:
            items[7] = draw(wire_values)
        return items
    return _with_header_items(frames, edit)


def hostile_tensor_descs(draw, frames):
    """Header descriptors with huge, negative or too many dims and unknown dtypes; buffer frames
    often made to match the declared count, and empty (so zero-size descriptors pass the size check)."""
    descs = draw(st.lists(hostile_descs, max_size=4))
    frames = _with_header_items(frames, lambda items: [*items[:6], [list(d) for d in descs], *items[7:]])
    if draw(st.booleans()):
        small = st.sampled_from([b"", b"\0" * 4, b"\0" * 8])
        bufs = draw(st.lists(small, min_size=len(descs), max_size=len(descs)))
        frames = [*frames[:2], *bufs]
    return frames


def deep_nesting(draw, frames):
    """A body nested thousands of arrays deep (stack exhaustion in a recursive decoder)."""
    depth = draw(st.integers(1, 20_000))
    nested = msgspec.Raw(b"\x91" * depth + b"\xc0")
    return _with_header_items(frames, lambda items: [*items[:7], nested, *items[8:]])


def huge_declared_length(draw, frames):
    """A 32-bit array/map/str/bin length prefix spliced into the header (claims GiBs it lacks)."""
    if len(frames) < 2:
        return frames
    prefix = draw(st.sampled_from([b"\xdd", b"\xdf", b"\xdb", b"\xc6"]))
    length = draw(st.sampled_from([b"\xff\xff\xff\xff", b"\x7f\xff\xff\xff", b"\x00\x10\x00\x00"]))
    header = frames[1]
    at = draw(st.integers(0, len(header)))
    return [frames[0], header[:at] + prefix + length + header[at:], *frames[2:]]


MUTATIONS = [flip_bits, truncate, extend, drop_frame, duplicate_frame, reorder, swap_tag,
             random_header, edit_header_field, edit_body, hostile_tensor_descs, deep_nesting,
             huge_declared_length]


@st.composite
def mutated_frames(draw, classes=None, mutations=tuple(MUTATIONS), max_mutations=3) -> list[bytes]:
    """A valid encoding damaged by 1..max_mutations mutations."""
    frames = draw(encoded_messages(classes)).frames
    for _ in range(draw(st.integers(1, max_mutations))):
        if not frames:
            break
        frames = draw(st.sampled_from(mutations))(draw, frames)
    return frames


def random_frame_lists() -> st.SearchStrategy:
    """Frame lists of random bytes in every bytes-like container, optionally behind a real tag."""
    frame = st.binary(max_size=64)
    as_container = st.sampled_from([bytes, bytearray, memoryview])
    frames = st.lists(st.tuples(as_container, frame).map(lambda cf: cf[0](cf[1])), max_size=8)
    real_tag = st.sampled_from(list(catalogue())).map(lambda tag: tag.to_bytes(2, "big"))
    return frames | st.tuples(real_tag, frames).map(lambda tf: [tf[0], *tf[1]])
