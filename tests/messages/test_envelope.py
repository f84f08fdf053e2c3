"""The envelope: frames `[tag, header, *buffers]` round trip, stay zero-copy, evolve, and refuse
what is not ours with a typed WireError."""
from __future__ import annotations

import math
import os

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from messages import SCHEMA_VERSION, Codec, Header, Message, WireLimits, registry, tag_of
from messages.control import Echo, Heartbeat
from messages.errors import FrameTooLarge, MalformedFrame, SchemaVersionMismatch, UnknownMessageType
from messages.tensors import ITEMSIZE, NUMPY_NATIVE, TensorDesc, describe
from tests.messages.strategies_test_helpers import (NUMPY_DTYPES, TEST_TAGS, WIRE_DTYPES, buffers,
                                                    catalogue, message_strategy)

CATALOGUE = catalogue()
ROUND_TRIP = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def received(frames) -> list:
    """Frames as a receiver holds them: writable buffers of their own (like zmq.Frame.buffer)."""
    return [bytearray(f) for f in frames]


def address_range(frame) -> tuple[int, int]:
    start = np.frombuffer(frame, dtype=np.uint8).ctypes.data
    return start, start + memoryview(frame).nbytes


def header_of(frames) -> Header:
    return msgspec.msgpack.decode(frames[1], type=Header)


def with_header(frames, **changes) -> list:
    header = msgspec.structs.replace(header_of(frames), **changes)
    return [frames[0], msgspec.msgpack.encode(header), *frames[2:]]


def sample_frame(name: str, shape=(3, 5)):
    """Random bit patterns of `name` (NaNs and infs included for floats, 0/1 for bool): a numpy
    array where numpy has the dtype, else a (TensorDesc, buffer) pair."""
    count = math.prod(shape)
    if name == "bool":
        return np.array([i % 3 == 0 for i in range(count)], dtype=bool).reshape(shape)
    raw = bytearray(os.urandom(count * ITEMSIZE[name]))
    if name in NUMPY_NATIVE:
        return np.frombuffer(raw, dtype=name).reshape(shape)
    return TensorDesc(name, tuple(shape)), memoryview(raw)


def same_bits(a, b) -> bool:
    """Equal descriptor (dtype, shape) and bytes; a and b as anything `describe` takes."""
    (desc_a, view_a), (desc_b, view_b) = describe(a), describe(b)
    return desc_a == desc_b and view_a == view_b


@pytest.fixture
def scratch_registry(monkeypatch):
    """A private copy of the type table, so a test can register (and re-register) test types."""
    monkeypatch.setattr(registry, "_BY_TAG", dict(registry._BY_TAG))
    monkeypatch.setattr(registry, "_BY_TYPE", dict(registry._BY_TYPE))
    return registry


# ---- round trips ------------------------------------------------------------------------------

def test_catalogue_is_registered_under_its_tags():
    assert len(CATALOGUE) >= 20, "message modules were not imported"
    for tag, cls in CATALOGUE.items():
        assert issubclass(cls, Message) and tag_of(cls) == tag


@pytest.mark.parametrize("tag", CATALOGUE, ids=[cls.__name__ for cls in CATALOGUE.values()])
@ROUND_TRIP
@given(data=st.data())
def test_every_message_type_round_trips(tag, data):
    cls = CATALOGUE[tag]
    message = data.draw(message_strategy(cls))
    sent = data.draw(st.lists(buffers(), max_size=3))
    frames = Codec(sender="worker-1").encode(message, request_id="req-1", traceparent="00-abc-def-01",
                                             buffers=sent, msg_id="m1", in_reply_to="m0")
    assert frames[0] == tag.to_bytes(2, "big")
    envelope = Codec().decode(received(frames))
    assert type(envelope.message) is cls
    assert envelope.message == message
    header = envelope.header
    assert (header.version, header.msg_id, header.request_id, header.traceparent, header.sender,
            header.in_reply_to) == (SCHEMA_VERSION, "m1", "req-1", "00-abc-def-01", "worker-1", "m0")
    assert envelope.request_id == "req-1" and len(envelope.buffers) == len(sent)
    for i, buf in enumerate(sent):
        assert same_bits(envelope.frame(i), buf)


def test_messages_get_fresh_msg_ids():
    codec = Codec()
    ids = {header_of(codec.encode(Echo())).msg_id for _ in range(100)}
    assert len(ids) == 100


# ---- tensor frames ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", WIRE_DTYPES)
def test_frames_of_every_dtype_arrive_bit_identical(name):
    sent = [sample_frame(name), sample_frame(name, shape=(2, 1, 4)), sample_frame(name, shape=())]
    envelope = Codec().decode(received(Codec().encode(Echo(b"t"), buffers=sent)))
    assert [d.dtype for d in envelope.header.tensors] == [name] * 3
    for i, frame in enumerate(sent):
        assert same_bits(envelope.frame(i), frame)


@pytest.mark.parametrize("name", NUMPY_DTYPES)
def test_numpy_arrays_arrive_with_their_dtype_and_shape(name):
    array = sample_frame(name)
    desc, view = Codec().decode(received(Codec().encode(Echo(), buffers=[array]))).frame(0)
    assert desc == TensorDesc(name, (3, 5)) and view.tobytes() == array.tobytes()


def test_raw_bytes_travel_as_uint8():
    envelope = Codec().decode(received(Codec().encode(Echo(), buffers=[b"\x00\x01\xff"])))
    assert envelope.header.tensors == [TensorDesc("uint8", (3,))]
    assert envelope.frame(0)[1].tolist() == [0, 1, 255]


@pytest.mark.parametrize("name", ["bfloat16", "float32", "int64", "float8_e4m3fn"])
def test_a_received_frame_is_a_view_of_its_buffer(name):
    frames = received(Codec().encode(Echo(), buffers=[sample_frame(name), sample_frame(name, (7,))]))
    envelope = Codec().decode(frames)
    for i, frame in enumerate(frames[2:]):
        _, view = envelope.frame(i)
        start, end = address_range(frame)
        assert start <= address_range(view)[0] and address_range(view)[1] <= end
        frame[0] ^= 0xFF  # writing through the frame shows in the view: same memory
        assert view[0] == frame[0]


@pytest.mark.parametrize("name", ["float32", "bfloat16"])
def test_sent_buffers_are_views_of_the_source(name):
    source = sample_frame(name, (4, 8))
    frame = Codec().encode(Echo(), buffers=[source])[2]
    assert address_range(frame)[0] == address_range(describe(source)[1])[0]
    assert frame.nbytes == 4 * 8 * ITEMSIZE[name]


def test_contiguous_slice_sends_only_its_own_elements():
    base = np.arange(20, dtype=np.int32)
    desc, view = Codec().decode(received(Codec().encode(Echo(), buffers=[base[5:9]]))).frame(0)
    assert desc == TensorDesc("int32", (4,)) and np.frombuffer(view, np.int32).tolist() == [5, 6, 7, 8]


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5, 2), (2, 0, 0)])
@pytest.mark.parametrize("name", ["bfloat16", "float32", "uint8", "bool"])
def test_empty_frames_round_trip(name, shape):
    sent = sample_frame(name, shape)
    frames = Codec().encode(Echo(), buffers=[sent])
    assert memoryview(frames[2]).nbytes == 0
    desc, view = Codec().decode(received(frames)).frame(0)
    assert desc == TensorDesc(name, shape) and view.nbytes == 0


def test_received_desc_buffer_pair_is_forwarded_as_is():
    first = Codec().decode(received(Codec().encode(Echo(), buffers=[sample_frame("bfloat16")])))
    desc, buf = first.frame(0)
    forwarded = Codec(sender="router").encode(Heartbeat("w", 1), buffers=[(desc, buf)])
    assert address_range(forwarded[2])[0] == address_range(buf)[0]
    second = Codec().decode(received(forwarded))
    assert second.header.tensors == [desc]
    assert same_bits(second.frame(0), first.frame(0))


def test_non_contiguous_arrays_are_refused():
    with pytest.raises(ValueError, match="C-contiguous"):
        Codec().encode(Echo(), buffers=[np.arange(12).reshape(3, 4)[:, ::2]])


def test_dtypes_that_cannot_travel_are_refused():
    with pytest.raises(ValueError, match="cannot travel"):
        Codec().encode(Echo(), buffers=[np.zeros(2, dtype=np.complex64)])


def test_frame_index_beyond_the_buffers_is_malformed():
    envelope = Codec().decode(Codec().encode(Echo(), buffers=[b"ab"]))
    with pytest.raises(MalformedFrame, match="tensor 1"):
        envelope.frame(1)


# ---- schema evolution -----------------------------------------------------------------------

class PingV1(Message):
    seq: int
    note: str = ""


class PingV2(Message):       # the same message one release later: a field appended with a default
    seq: int
    note: str = ""
    priority: int = 0
    tags: list[str] = []


def _speak(scratch_registry, cls: type[Message]) -> None:
    """Make `cls` the type behind the test tag, as a process built with that version would."""
    scratch_registry._BY_TAG[TEST_TAGS + 1] = cls
    scratch_registry._BY_TYPE[cls] = TEST_TAGS + 1


def test_old_sender_is_decoded_by_new_receiver_with_defaults(scratch_registry):
    _speak(scratch_registry, PingV1)
    frames = Codec().encode(PingV1(seq=7, note="old"))
    _speak(scratch_registry, PingV2)
    assert Codec().decode(frames).message == PingV2(seq=7, note="old", priority=0, tags=[])


def test_new_sender_is_decoded_by_old_receiver_ignoring_new_fields(scratch_registry):
    _speak(scratch_registry, PingV2)
    frames = Codec().encode(PingV2(seq=7, note="new", priority=3, tags=["a"]))
    _speak(scratch_registry, PingV1)
    assert Codec().decode(frames).message == PingV1(seq=7, note="new")


def test_header_without_in_reply_to_still_decodes():
    frames = Codec().encode(Echo(b"x"), request_id="r")
    items = msgspec.msgpack.decode(frames[1])[:-1]    # an older header layout, one field shorter
    envelope = Codec().decode([frames[0], msgspec.msgpack.encode(items)])
    assert envelope.header.in_reply_to == "" and envelope.message == Echo(b"x")


# ---- refusals -------------------------------------------------------------------------------

@pytest.mark.parametrize("version", [0, SCHEMA_VERSION + 1, -1, 2**40])
def test_other_schema_version_is_refused(version):
    frames = with_header(Codec().encode(Echo(), request_id="r-9"), version=version)
    with pytest.raises(SchemaVersionMismatch) as caught:
        Codec().decode(frames)
    assert caught.value.request_id == "r-9" and caught.value.to_reply().code == 3


@pytest.mark.parametrize("tag", [0x0000, 0x01FF, TEST_TAGS + 0xFF, 0xFFFF])
def test_unknown_tag_is_refused(tag):
    frames = Codec().encode(Echo())
    with pytest.raises(UnknownMessageType, match=f"{tag:#06x}"):
        Codec().decode([tag.to_bytes(2, "big"), *frames[1:]])


@pytest.mark.parametrize("tag_frame", [b"", b"\x01", b"\x00\x01\x08"])
def test_tag_frame_of_wrong_size_is_malformed(tag_frame):
    with pytest.raises(MalformedFrame, match="2 bytes"):
        Codec().decode([tag_frame, Codec().encode(Echo())[1]])


@pytest.mark.parametrize("frames", [[], [b"\x01\x08"]])
def test_fewer_than_two_frames_is_malformed(frames):
    with pytest.raises(MalformedFrame, match="at least 2 frames"):
        Codec().decode(frames)


def test_buffer_count_differing_from_the_header_is_malformed():
    frames = Codec().encode(Echo(), buffers=[b"abc", b"de"])
    with pytest.raises(MalformedFrame, match="describes 2 buffers, 1 arrived"):
        Codec().decode(frames[:-1])
    with pytest.raises(MalformedFrame, match="describes 2 buffers, 3 arrived"):
        Codec().decode([*frames, b"x"])


@pytest.mark.parametrize("resize", [lambda b: b[:-1], lambda b: b + b"\0", lambda b: b""],
                         ids=["short", "long", "empty"])
def test_buffer_size_differing_from_its_descriptor_is_malformed(resize):
    frames = Codec().encode(Echo(), buffers=[sample_frame("float32")])
    with pytest.raises(MalformedFrame, match=r"float32\[3, 5\] needs 60"):
        Codec().decode([*frames[:2], resize(bytes(frames[2]))])


@pytest.mark.parametrize("desc", [TensorDesc("complex64", (1,)), TensorDesc("uint8", (-1,)),
                                  TensorDesc("uint8", (1,) * 9)])
def test_invalid_descriptor_is_malformed(desc):
    frames = with_header(Codec().encode(Echo(), buffers=[b"x"]), tensors=[desc])
    with pytest.raises(MalformedFrame):
        Codec().decode(frames)


@pytest.mark.parametrize("header", [b"", b"\xc1", b"\x93\x01\x02\x03", msgspec.msgpack.encode("hello")])
def test_header_that_is_not_a_header_is_malformed(header):
    with pytest.raises(MalformedFrame, match="bad header"):
        Codec().decode([b"\x01\x08", header])


def test_body_of_another_type_is_malformed():
    frames = Codec().encode(Echo(b"x"))
    with pytest.raises(MalformedFrame, match="bad Heartbeat body"):
        Codec().decode([tag_of(Heartbeat).to_bytes(2, "big"), frames[1]])


# ---- limits ---------------------------------------------------------------------------------

def test_frame_count_over_the_limit_is_too_large():
    frames = Codec().encode(Echo(), buffers=[b"a", b"b"])
    assert Codec(limits=WireLimits(max_frames=4)).decode(frames)
    with pytest.raises(FrameTooLarge, match="4 frames"):
        Codec(limits=WireLimits(max_frames=3)).decode(frames)


def test_header_over_the_limit_is_too_large():
    frames = Codec().encode(Echo(b"p" * 100))
    size = len(frames[1])
    assert Codec(limits=WireLimits(max_header_bytes=size)).decode(frames)
    with pytest.raises(FrameTooLarge, match="header"):
        Codec(limits=WireLimits(max_header_bytes=size - 1)).decode(frames)


def test_buffer_over_the_limit_is_too_large():
    frames = Codec().encode(Echo(), buffers=[b"x" * 64])
    assert Codec(limits=WireLimits(max_buffer_bytes=64)).decode(frames)
    with pytest.raises(FrameTooLarge, match="buffer of 64 bytes"):
        Codec(limits=WireLimits(max_buffer_bytes=63)).decode(frames)


def test_message_over_the_total_limit_is_too_large():
    frames = Codec().encode(Echo(), buffers=[b"x" * 64, b"y" * 64])
    total = len(frames[1]) + 128
    assert Codec(limits=WireLimits(max_total_bytes=total)).decode(frames)
    with pytest.raises(FrameTooLarge, match=f"{total} bytes"):
        Codec(limits=WireLimits(max_total_bytes=total - 1)).decode(frames)
