"""Tensors as frames: a TensorDesc in the header describes each buffer frame after it.

A frame is a dtype name, a shape and a byte buffer; no tensor library is needed to move one (so a
process that only routes or stores messages never loads the engine's). Sending: `describe` gives the
descriptor and a zero-copy byte view of a numpy array, a bytes-like buffer, or a (TensorDesc,
buffer) pair. bfloat16 and float8_e4m3fn have no numpy dtype: they travel as (TensorDesc, buffer)
pairs. Receiving: `Envelope.frame(i)` gives the checked (TensorDesc, memoryview); workers turn
engine tensors into frames and back in `services/workers/tensors.py`.
"""
from __future__ import annotations

import math

import msgspec
import numpy as np

from messages.errors import MalformedFrame

# Wire names of the dtypes we move, with their item sizes (the engine's dtype names).
ITEMSIZE: dict[str, int] = {
    "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "float16": 2, "bfloat16": 2,
    "float32": 4, "float64": 8, "bool": 1, "float8_e4m3fn": 1,
}
NUMPY_NATIVE = frozenset(name for name in ITEMSIZE if name not in ("bfloat16", "float8_e4m3fn"))
MAX_NDIM = 8
_INT64_MAX = 2**63 - 1


class TensorDesc(msgspec.Struct, array_like=True, gc=False):
    """dtype and shape of one buffer frame; frame i after the header is described by tensors[i]."""

    dtype: str
    shape: tuple[int, ...]

    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


def describe(buf) -> tuple[TensorDesc, memoryview]:
    """The descriptor and a zero-copy byte view of a numpy array, a bytes-like buffer, or a
    (TensorDesc, buffer) pair (one received earlier is forwarded as it is)."""
    if isinstance(buf, tuple) and len(buf) == 2 and isinstance(buf[0], TensorDesc):
        view = memoryview(buf[1])
        return buf[0], view if view.format == "B" and view.ndim == 1 else view.cast("B")
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("send C-contiguous arrays")
        name = buf.dtype.name
        if name not in NUMPY_NATIVE:
            raise ValueError(f"dtype {name} cannot travel")
        return TensorDesc(name, tuple(buf.shape)), memoryview(buf.reshape(-1).view(np.uint8))
    try:
        view = memoryview(buf).cast("B")
    except TypeError:   # an engine tensor, most likely: say where the conversion lives
        raise TypeError(f"cannot send a {type(buf).__name__}: send numpy arrays, bytes or (TensorDesc, buffer) "
                        "pairs (engine tensors: services.workers.tensors.to_frame)") from None
    return TensorDesc("uint8", (view.nbytes,)), view


def check(desc: TensorDesc, nbytes: int) -> None:
    """Raise MalformedFrame unless the frame of `nbytes` matches its descriptor."""
    if desc.dtype not in ITEMSIZE:
        raise MalformedFrame(f"unknown tensor dtype {desc.dtype!r}")
    if len(desc.shape) > MAX_NDIM or any(d < 0 for d in desc.shape) or _strides_overflow(desc.shape):
        raise MalformedFrame(f"invalid tensor shape {desc.shape}")
    if desc.nbytes() != nbytes:
        raise MalformedFrame(f"tensor frame holds {nbytes} bytes, descriptor {desc.dtype}{list(desc.shape)} needs {desc.nbytes()}")


def _strides_overflow(shape: tuple[int, ...]) -> bool:
    """True where a tensor library cannot build the shape: its strides (sizes taken as at least 1)
    pass int64. Only an empty frame can claim such a shape, as a 0 dim makes its byte count 0."""
    return math.prod(max(d, 1) for d in shape) > _INT64_MAX

