"""Weights kept in a checkpoint's quantized format, for kernels that read them directly.

A `Packed` is a matrix, or a stack of matrices (experts), in one of three formats:

  fp8    data float8_e4m3fn [..., N, K]; scale e8m0 bytes [..., ceil(N / bn), ceil(K / bk)];
         block (bn, bk): (128, 128) in V4 checkpoints, (32, 32) in V4.1
  mxfp4  data int8 [..., N, K / 2] (column 2k in the low nibble of byte k, 2k+1 in the high);
         scale e8m0 bytes [..., N, K / 32]; block (1, 32)
  bf16   data [..., N, K] in the activation dtype; no scale (the unquantized baseline)

N is the output features (rows of an nn.Linear weight), K the input features. Scales are stored
as uint8 (the raw e8m0 byte, value 2**(byte - 127)): Triton reads bytes, not float8_e8m0fnu.
`dequantize()` is the plain-torch reference every kernel is tested against.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.quant.e8m0 import exponent_bytes
from engine.quant.fp8_blocks import dequantize_fp8, quantize_fp8
from engine.quant.mxfp4 import GROUP, dequantize_mxfp4, quantize_mxfp4

FORMATS = ("fp8", "mxfp4", "bf16")


class Packed(NamedTuple):
    fmt: str
    data: torch.Tensor
    scale: torch.Tensor | None
    block: tuple[int, int]

    @property
    def out_features(self) -> int:
        return self.data.shape[-2]

    @property
    def in_features(self) -> int:
        return self.data.shape[-1] * (2 if self.fmt == "mxfp4" else 1)

    @property
    def nbytes(self) -> int:
        """Bytes a kernel reads to use the whole weight once (data + scales)."""
        scale = 0 if self.scale is None else self.scale.numel() * self.scale.element_size()
        return self.data.numel() * self.data.element_size() + scale

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The weight as [..., N, K] in `dtype` (the reference)."""
        if self.fmt == "bf16":
            return self.data.to(dtype)
        lead = self.data.shape[:-2]
        data = self.data.reshape(-1, *self.data.shape[-2:])
        scale = self.scale.reshape(-1, *self.scale.shape[-2:])
        if self.fmt == "fp8":
            mats = [dequantize_fp8(d, s, *self.block, dtype) for d, s in zip(data, scale)]
        else:
            mats = [dequantize_mxfp4(d, s, dtype) for d, s in zip(data, scale)]
        return torch.stack(mats).reshape(*lead, self.out_features, self.in_features)

    def to(self, device) -> "Packed":
        scale = None if self.scale is None else self.scale.to(device)
        return Packed(self.fmt, self.data.to(device), scale, self.block)


def pack(weight: torch.Tensor, fmt: str, block: int = 128) -> Packed:
    """Quantize a [..., N, K] weight (a matrix or a stack) into `fmt`, one matrix at a time.

    `block` is the FP8 square block (128 for V4, 32 for V4.1); MXFP4 always groups 32 columns.
    """
    if fmt not in FORMATS:
        raise ValueError(f"weight format must be one of {FORMATS}, got {fmt!r}")
    if fmt == "bf16":
        return Packed("bf16", weight, None, (1, 1))
    lead, (rows, columns) = weight.shape[:-2], weight.shape[-2:]
    mats = weight.reshape(-1, rows, columns)
    if fmt == "fp8":
        parts = [quantize_fp8(m, block, block) for m in mats]
        shape = (block, block)
    else:
        if columns % GROUP:
            raise ValueError(f"MXFP4 needs input features divisible by {GROUP}, got {columns}")
        parts = [quantize_mxfp4(m) for m in mats]
        shape = (1, GROUP)
    data = torch.stack([p[0] for p in parts])
    scale = torch.stack([exponent_bytes(p[1]) for p in parts])
    return Packed(fmt, data.reshape(*lead, *data.shape[1:]), scale.reshape(*lead, *scale.shape[1:]), shape)


def from_checkpoint(fmt: str, data: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> Packed:
    """A stored quantized weight as a Packed (e8m0 scales viewed as bytes)."""
    return Packed(fmt, data, exponent_bytes(scale), tuple(block))
