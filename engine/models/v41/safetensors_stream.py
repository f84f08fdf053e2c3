"""Write a safetensors file piece by piece, so no tensor has to sit in memory whole.

The layout is fixed up front (8-byte little-endian header length, a JSON header padded with
spaces to 8 bytes, then every tensor's bytes back to back in header order); the data is then
written at byte offsets within each tensor, in any order. Readers (safetensors, NeMo, vLLM)
see an ordinary file.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

DTYPE_NAMES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e8m0fnu: "F8_E8M0",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.int32: "I32",
    torch.int64: "I64",
}


class SafetensorsStream:
    """`with SafetensorsStream(path, [(name, shape, dtype), ...]) as f: f.write(name, offset, tensor)`."""

    def __init__(self, path: str | Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        self.regions: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, shape, dtype in entries:
            size = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            self.regions[name] = (offset, size)
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.data_start = 8 + len(text)
        self.total_bytes = offset
        self.file = open(self.path, "wb")
        self.file.write(struct.pack("<Q", len(text)) + text)
        self.file.truncate(self.data_start + offset)

    def write(self, name: str, byte_offset: int, tensor: torch.Tensor) -> None:
        """Place `tensor`'s bytes (row-major) at `byte_offset` within tensor `name`."""
        start, size = self.regions[name]
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        if byte_offset + data.nbytes > size:
            raise ValueError(f"{name}: writing {data.nbytes} bytes at {byte_offset} overruns its {size}")
        self.file.seek(self.data_start + start + byte_offset)
        self.file.write(memoryview(data))

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> "SafetensorsStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
