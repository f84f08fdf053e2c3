"""Torch tensors <-> wire frames, for the processes that run an engine.

The contract (`messages.tensors`) moves frames, (TensorDesc, byte buffer) pairs, without torch.
Workers send engine tensors with `to_frame` and open received frames with `torch_view` /
`torch_frame`; both directions share memory, never copy (but for read-only bytes, see torch_view).
"""
from __future__ import annotations

import torch

from messages.envelope import Envelope
from messages.tensors import ITEMSIZE, NUMPY_NATIVE, TensorDesc

DTYPES: dict[str, torch.dtype] = {
    "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16, "int32": torch.int32,
    "int64": torch.int64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float32": torch.float32, "float64": torch.float64, "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
_NAME_OF = {dtype: name for name, dtype in DTYPES.items()}
assert set(DTYPES) == set(ITEMSIZE), "the wire's dtype table and torch's must name the same dtypes"


def to_frame(t: torch.Tensor) -> tuple[TensorDesc, memoryview]:
    """A contiguous CPU tensor as a frame: its descriptor and a byte view of its memory (no copy;
    the view keeps the tensor alive)."""
    if not t.is_cpu:
        raise ValueError("move tensors to the CPU (pinned memory) before sending")
    if not t.is_contiguous():
        raise ValueError("send contiguous tensors; call .contiguous() first (an explicit copy)")
    name = _NAME_OF.get(t.dtype)
    if name is None:
        raise ValueError(f"dtype {t.dtype} cannot travel")
    desc = TensorDesc(name, tuple(t.shape))
    if not t.numel():
        return desc, memoryview(b"")
    t = t.detach()
    if name in NUMPY_NATIVE:   # numpy shares the memory directly (no reshape/view round trip)
        return desc, memoryview(t.numpy()).cast("B")
    return desc, memoryview(t.reshape(-1).view(torch.uint8).numpy())   # bf16 / fp8: through their bytes


def torch_view(desc: TensorDesc, buf) -> torch.Tensor:
    """A torch tensor over a received frame (no copy; it keeps the buffer alive). Read-only buffers
    (bytes) are copied once: torch shares only writable memory."""
    dtype = DTYPES[desc.dtype]
    view = buf if type(buf) is memoryview else memoryview(buf)
    if view.nbytes == 0:
        return torch.empty(desc.shape, dtype=dtype)
    if view.readonly:
        view = memoryview(bytearray(view))
    return torch.frombuffer(view, dtype=dtype).view(desc.shape)


def torch_frame(envelope: Envelope, index: int) -> torch.Tensor:
    """Buffer frame `index` of a received message as a torch tensor view (no copy)."""
    return torch_view(*envelope.frame(index))
