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

from collections.abc import Iterator
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

    def expert(self, index: int) -> "Packed":
        """One matrix of a stack (a routed expert)."""
        scale = None if self.scale is None else self.scale[index]
        return Packed(self.fmt, self.data[index], scale, self.block)

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
    lead = weight.shape[:-2]
    mats = weight.reshape(-1, *weight.shape[-2:])
    packed = pack_stack(iter(mats), len(mats), fmt, block)
    return Packed(fmt, packed.data.reshape(*lead, *packed.data.shape[1:]),
                  packed.scale.reshape(*lead, *packed.scale.shape[1:]), packed.block)


def pack_stack(matrices: Iterator[torch.Tensor], count: int, fmt: str, block: int = 128) -> Packed:
    """Quantize `count` same-shaped matrices into one stacked Packed [count, N, K'], filling a
    preallocated output: peak memory is the packed stack plus one matrix (a whole bf16 stack of
    experts need never exist; the matrices may be built one by one)."""
    if fmt not in FORMATS or fmt == "bf16":
        raise ValueError(f"quantized weight format must be 'fp8' or 'mxfp4', got {fmt!r}")
    data = scale = None
    for i, matrix in enumerate(matrices):
        if fmt == "fp8":
            values, scales = quantize_fp8(matrix, block, block)
        else:
            if matrix.shape[-1] % GROUP:
                raise ValueError(f"MXFP4 needs input features divisible by {GROUP}, got {matrix.shape[-1]}")
            values, scales = quantize_mxfp4(matrix)
        if data is None:
            data = values.new_empty(count, *values.shape)
            scale = torch.empty(count, *scales.shape, dtype=torch.uint8, device=values.device)
        data[i], scale[i] = values, exponent_bytes(scales)
    if data is None:
        raise ValueError("nothing to pack")
    return Packed(fmt, data, scale, (block, block) if fmt == "fp8" else (1, GROUP))


def from_checkpoint(fmt: str, data: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> Packed:
    """A stored quantized weight as a Packed (e8m0 scales viewed as bytes)."""
    return Packed(fmt, data, exponent_bytes(scale), tuple(block))
