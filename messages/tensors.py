"""Tensors as frames: a TensorDesc in the header describes each buffer frame after it.

Sending: `to_buffer` gives a zero-copy byte view of a contiguous CPU tensor or array.
Receiving: `tensor_view` wraps the received frame as a torch tensor without copying.
"""
from __future__ import annotations

import math

import msgspec
import numpy as np
import torch

from messages.errors import MalformedFrame

# Wire names of the dtypes we move. bfloat16 has no numpy dtype, so torch is the view type.
_TORCH_DTYPES: dict[str, torch.dtype] = {
    "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16, "int32": torch.int32,
    "int64": torch.int64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float32": torch.float32, "float64": torch.float64, "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
_NAME_OF_TORCH = {v: k for k, v in _TORCH_DTYPES.items()}
_ITEMSIZE = {name: torch.empty((), dtype=dt).element_size() for name, dt in _TORCH_DTYPES.items()}
MAX_NDIM = 8
_NUMPY_NATIVE = frozenset(name for name in _TORCH_DTYPES if name not in ("bfloat16", "float8_e4m3fn"))
_INT64_MAX = 2**63 - 1


class TensorDesc(msgspec.Struct, array_like=True, gc=False):
    """dtype and shape of one buffer frame; frame i after the header is described by tensors[i]."""

    dtype: str
    shape: tuple[int, ...]

    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEMSIZE[self.dtype]


def describe(buf) -> tuple[TensorDesc, memoryview]:
    """The descriptor and a zero-copy byte view of a tensor, array, bytes-like buffer, or a
    (TensorDesc, buffer) pair received earlier (forwarded as it is)."""
    if isinstance(buf, tuple) and len(buf) == 2 and isinstance(buf[0], TensorDesc):
        return buf[0], memoryview(buf[1])
    if isinstance(buf, torch.Tensor):
        if not buf.is_cpu:
            raise ValueError("move tensors to the CPU (pinned memory) before sending")
        if not buf.is_contiguous():
            raise ValueError("send contiguous tensors; call .contiguous() first (an explicit copy)")
        name = _NAME_OF_TORCH.get(buf.dtype)
        if name is None:
            raise ValueError(f"dtype {buf.dtype} cannot travel")
        desc = TensorDesc(name, tuple(buf.shape))
        if not buf.numel():
            return desc, memoryview(torch.empty(0, dtype=torch.uint8).numpy())
        if name in _NUMPY_NATIVE and not buf.requires_grad:   # numpy shares the memory directly; no reshape/view round trip
            return desc, memoryview(buf.numpy()).cast("B")
        return desc, memoryview(buf.reshape(-1).view(torch.uint8).numpy())
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("send C-contiguous arrays")
        name = buf.dtype.name
        if name not in _TORCH_DTYPES:
            raise ValueError(f"dtype {name} cannot travel")
        return TensorDesc(name, tuple(buf.shape)), memoryview(buf.reshape(-1).view(np.uint8))
    view = memoryview(buf).cast("B")
    return TensorDesc("uint8", (view.nbytes,)), view


def check(desc: TensorDesc, nbytes: int) -> None:
    """Raise MalformedFrame unless the frame of `nbytes` matches its descriptor."""
    if desc.dtype not in _ITEMSIZE:
        raise MalformedFrame(f"unknown tensor dtype {desc.dtype!r}")
    if len(desc.shape) > MAX_NDIM or any(d < 0 for d in desc.shape) or _strides_overflow(desc.shape):
        raise MalformedFrame(f"invalid tensor shape {desc.shape}")
    if desc.nbytes() != nbytes:
        raise MalformedFrame(f"tensor frame holds {nbytes} bytes, descriptor {desc.dtype}{list(desc.shape)} needs {desc.nbytes()}")


def _strides_overflow(shape: tuple[int, ...]) -> bool:
    """True where torch cannot build the shape: its strides (sizes taken as at least 1) pass int64.
    Only an empty frame can claim such a shape, as a 0 dim makes its byte count 0."""
    return math.prod(max(d, 1) for d in shape) > _INT64_MAX


def tensor_view(desc: TensorDesc, buf) -> torch.Tensor:
    """A torch tensor over the received buffer (no copy; it keeps the buffer alive)."""
    dtype = _TORCH_DTYPES[desc.dtype]
    view = buf if type(buf) is memoryview else memoryview(buf)
    if view.nbytes == 0:
        return torch.empty(desc.shape, dtype=dtype)
    if view.readonly:  # bytes objects: torch needs a writable buffer to share, so copy once
        view = memoryview(bytearray(view))
    return torch.frombuffer(view, dtype=dtype).view(desc.shape)
