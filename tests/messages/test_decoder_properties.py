"""Whatever arrives, `Codec.decode` either returns an Envelope holding the type registered for the
tag or raises a WireError: never another exception, never an allocation a frame only claims."""
from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from messages import SCHEMA_VERSION, Codec, Envelope, WireError
from messages.control import Echo
from messages.errors import MalformedFrame
from messages.registry import type_of
from messages.tensors import TensorDesc
from tests.messages.strategies_test_helpers import (UINT_MAX, catalogue, deep_nesting, hostile_descs,
                                                    hostile_tensor_descs, huge_declared_length,
                                                    mutated_frames, random_frame_lists, wire_values)

CATALOGUE = catalogue()
TYPE_IDS = [cls.__name__ for cls in CATALOGUE.values()]
# Sized for a 2-core CI box: each test (each parametrized case) stays well under 15 s.
FUZZ = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PER_TYPE = settings(max_examples=100, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def decodes_or_refuses(frames) -> Envelope | None:
    """Decode untrusted frames: a WireError is the one allowed failure. A decoded envelope holds
    the registered type and every buffer frame holds the bytes its descriptor declares."""
    try:
        envelope = Codec().decode(frames)
    except WireError:
        return None
    assert type(envelope.message) is type_of(int.from_bytes(bytes(frames[0]), "big"))
    for i, desc in enumerate(envelope.header.tensors):
        got, view = envelope.frame(i)
        assert got is desc and view.nbytes == desc.nbytes()
    return envelope


@FUZZ
@given(random_frame_lists())
def test_random_frame_lists_decode_or_raise_wire_errors(frames):
    decodes_or_refuses(frames)


@FUZZ
@given(tag=st.sampled_from(list(CATALOGUE)), header=wire_values,
       buffers=st.lists(st.binary(max_size=8), max_size=3))
def test_random_msgpack_headers_decode_or_raise_wire_errors(tag, header, buffers):
    decodes_or_refuses([tag.to_bytes(2, "big"), msgspec.msgpack.encode(header), *buffers])


@pytest.mark.parametrize("cls", CATALOGUE.values(), ids=TYPE_IDS)
@PER_TYPE
@given(data=st.data())
def test_mutated_encodings_decode_or_raise_wire_errors(cls, data):
    decodes_or_refuses(data.draw(mutated_frames([cls])))


@FUZZ
@given(data=st.data())
def test_hostile_tensor_descriptors_decode_or_raise_wire_errors(data):
    frames = data.draw(mutated_frames(mutations=[hostile_tensor_descs], max_mutations=1))
    decodes_or_refuses(frames)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_deep_nesting_and_huge_lengths_decode_or_raise_wire_errors(data):
    frames = data.draw(mutated_frames(mutations=[deep_nesting, huge_declared_length], max_mutations=2))
    decodes_or_refuses(frames)


@FUZZ
@given(st.lists(hostile_descs, min_size=1, max_size=3))
def test_descriptor_check_accepts_only_shapes_with_int64_strides(descs):
    """Zero-size descriptors match an empty frame whatever their other dims claim: such a header
    must be refused unless a tensor library could build the (empty) tensor it describes (its
    strides fit int64; tests/workers/test_tensors.py opens them in torch)."""
    header = [SCHEMA_VERSION, "m", "", "", "", 0.0, [list(d) for d in descs], msgspec.Raw(msgspec.msgpack.encode(Echo()))]
    decodes_or_refuses([b"\x01\x08", msgspec.msgpack.encode(header), *[b""] * len(descs)])


# ---- regressions found by the properties above --------------------------------------------------

def echo_frames(body: msgspec.Raw | None = None, tensors=(), buffers=()) -> list:
    body = body or msgspec.Raw(msgspec.msgpack.encode(Echo()))
    header = [SCHEMA_VERSION, "m", "r", "", "", 0.0, [list(t) for t in tensors], body]
    return [b"\x01\x08", msgspec.msgpack.encode(header), *buffers]


@pytest.mark.parametrize("depth", [5_000, 200_000])
def test_deeply_nested_body_is_malformed_not_recursion_error(depth):
    with pytest.raises(MalformedFrame):
        Codec().decode(echo_frames(body=msgspec.Raw(b"\x91" * depth + b"\xc0")))


@pytest.mark.parametrize("shape", [(0, 2**62, 4), (0, 2**64 - 1), (UINT_MAX, 0), (3, 2**63, 0)])
def test_empty_descriptor_with_overflowing_dims_is_malformed(shape):
    with pytest.raises(MalformedFrame, match="invalid tensor shape"):
        Codec().decode(echo_frames(tensors=[("float32", shape)], buffers=[b""]))


@pytest.mark.parametrize("shape", [(0, 2**62, 1), (2**63 - 1, 0), (0,) * 8])
def test_empty_descriptor_with_large_but_buildable_dims_decodes(shape):
    envelope = Codec().decode(echo_frames(tensors=[("bfloat16", shape)], buffers=[b""]))
    assert envelope.frame(0)[0] == TensorDesc("bfloat16", shape) and envelope.frame(0)[1].nbytes == 0
