"""Torch tensors <-> wire frames in the worker processes: every dtype round trips bit-identically,
neither direction copies, empty and read-only frames open, and whatever the decoder accepts opens
in torch with its declared shape."""
from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from messages import Codec, WireError
from messages.control import Echo
from messages.tensors import ITEMSIZE, TensorDesc
from services.workers.tensors import DTYPES, to_frame, torch_frame, torch_view
from tests.messages.strategies_test_helpers import hostile_descs, hostile_tensor_descs, mutated_frames

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def sample_tensor(name: str, shape=(3, 5)) -> torch.Tensor:
    """Random bit patterns of `name` (NaNs and infs included for floats, 0/1 for bool)."""
    count = int(np.prod(shape))
    if name == "bool":
        return torch.tensor([i % 3 == 0 for i in range(count)], dtype=torch.bool).reshape(shape)
    raw = bytearray(np.random.default_rng(count).bytes(count * ITEMSIZE[name]))
    return torch.frombuffer(raw, dtype=DTYPES[name]).reshape(shape) if count else torch.empty(shape, dtype=DTYPES[name])


def as_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype, a.shape) == (b.dtype, b.shape) and as_bytes(a) == as_bytes(b)


def over_the_wire(*tensors: torch.Tensor):
    frames = [bytearray(f) for f in Codec().encode(Echo(), buffers=[to_frame(t) for t in tensors])]
    return Codec().decode(frames), frames


@pytest.mark.parametrize("name", list(DTYPES))
def test_tensors_of_every_dtype_arrive_bit_identical(name):
    sent = [sample_tensor(name), sample_tensor(name, (2, 1, 4)), sample_tensor(name, ())]
    envelope, _ = over_the_wire(*sent)
    assert [d.dtype for d in envelope.header.tensors] == [name] * 3
    for i, tensor in enumerate(sent):
        assert same_bits(torch_frame(envelope, i), tensor)


@pytest.mark.parametrize("name", ["bfloat16", "float32", "int64", "float8_e4m3fn", "bool"])
def test_a_frame_is_a_view_of_the_tensor_and_the_tensor_a_view_of_the_frame(name):
    tensor = sample_tensor(name, (4, 8))
    desc, view = to_frame(tensor)
    assert desc == TensorDesc(name, (4, 8)) and np.frombuffer(view, np.uint8).ctypes.data == tensor.data_ptr()
    envelope, frames = over_the_wire(tensor)
    got = torch_frame(envelope, 0)
    assert got.data_ptr() == np.frombuffer(frames[2], np.uint8).ctypes.data
    frames[2][0] ^= 0xFF   # writing through the frame shows in the tensor: same memory
    assert got.reshape(-1).view(torch.uint8)[0].item() == frames[2][0]


def test_read_only_frames_are_copied_once_into_a_writable_tensor():
    frames = Codec().encode(Echo(), buffers=[to_frame(torch.arange(6, dtype=torch.int32))])
    envelope = Codec().decode([bytes(f) for f in frames])
    got = torch_frame(envelope, 0)
    got[0] = 7
    assert got.tolist() == [7, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5, 2)])
@pytest.mark.parametrize("name", ["bfloat16", "float32", "bool"])
def test_empty_tensors_round_trip_with_their_shape(name, shape):
    envelope, frames = over_the_wire(torch.empty(shape, dtype=DTYPES[name]))
    assert len(frames[2]) == 0
    got = torch_frame(envelope, 0)
    assert got.dtype == DTYPES[name] and got.shape == shape


def test_tensors_that_cannot_travel_are_refused():
    with pytest.raises(ValueError, match=r"contiguous.*\.contiguous\(\)"):
        to_frame(torch.arange(12, dtype=torch.float32).reshape(3, 4).t())
    with pytest.raises(ValueError, match="cannot travel"):
        to_frame(torch.zeros(2, dtype=torch.complex64))


def test_a_tensor_given_to_the_codec_is_refused_with_where_to_convert_it():
    with pytest.raises(TypeError, match="to_frame"):
        Codec().encode(Echo(), buffers=[torch.zeros(2)])


def test_a_tensor_that_requires_grad_travels_as_its_data():
    tensor = torch.randn(3, requires_grad=True)
    envelope, _ = over_the_wire(tensor)
    assert same_bits(torch_frame(envelope, 0), tensor.detach())


def opens_in_torch(frames) -> None:
    """Whatever the decoder accepts opens as a torch tensor of its declared shape."""
    try:
        envelope = Codec().decode(frames)
    except WireError:
        return
    for i, desc in enumerate(envelope.header.tensors):
        assert tuple(torch_frame(envelope, i).shape) == tuple(desc.shape)


@FUZZ
@given(data=st.data())
def test_hostile_descriptors_that_decode_open_in_torch(data):
    opens_in_torch(data.draw(mutated_frames(mutations=[hostile_tensor_descs], max_mutations=1)))


@FUZZ
@given(st.lists(hostile_descs, min_size=1, max_size=3))
def test_empty_frames_with_any_accepted_shape_open_in_torch(descs):
    header = [1, "m", "", "", "", 0.0, [list(d) for d in descs], msgspec.Raw(msgspec.msgpack.encode(Echo()))]
    opens_in_torch([b"\x01\x08", msgspec.msgpack.encode(header), *[b""] * len(descs)])


@pytest.mark.parametrize("shape", [(0, 2**62, 1), (2**63 - 1, 0), (0,) * 8])
def test_an_empty_frame_with_large_but_buildable_dims_opens(shape):
    assert torch_view(TensorDesc("bfloat16", shape), b"").shape == torch.Size(shape)
