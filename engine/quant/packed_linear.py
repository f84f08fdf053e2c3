"""Linear layers whose weights stay in a checkpoint's quantized format (`engine.quant.packed`).

On a GPU with kernels (`engine.kernels.dispatch`) the matmul reads the packed bytes directly
(`engine.kernels.quant_linear`); elsewhere the weight is dequantized for each call and F.linear
runs: slow, but the same numbers, so CPU tests can check a packed model against a plain one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.dispatch import kernel
from engine.models.common.linear import linear_groups
from engine.quant.packed import Packed, pack


class PackedLinear(nn.Module):
    """y = x W^T with W [out, in] packed. `groups` > 1 is V4's block-diagonal output projection:
    x [T, groups, in] and each group owns out/groups consecutive rows of W."""

    def __init__(self, packed: Packed, groups: int = 1):
        super().__init__()
        if packed.data.ndim != 2:
            raise ValueError(f"PackedLinear takes one matrix, got data of shape {tuple(packed.data.shape)}")
        if packed.out_features % groups or (groups > 1 and (packed.out_features // groups) % packed.block[0]):
            raise ValueError(f"{packed.out_features} rows do not split into {groups} groups of whole blocks")
        self.fmt, self.block, self.groups = packed.fmt, packed.block, groups
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.register_buffer("data", packed.data)
        self.register_buffer("scale", packed.scale)

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str, block: int) -> "PackedLinear":
        groups = linear_groups(linear)
        with torch.no_grad():
            return cls(pack(linear.weight.detach(), fmt, block), groups)

    @property
    def packed(self) -> Packed:
        return Packed(self.fmt, self.data, self.scale, self.block)

    def rows(self, group: int) -> Packed:
        """The packed rows of one output group (scales cut at the same block boundary)."""
        size = self.out_features // self.groups
        data = self.data[group * size : (group + 1) * size]
        scale = None
        if self.scale is not None:
            per_block = size // self.block[0]
            scale = self.scale[group * per_block : (group + 1) * per_block]
        return Packed(self.fmt, data, scale, self.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.groups == 1:
            return _matmul(x, self.packed)
        return torch.cat([_matmul(x[:, g], self.rows(g)) for g in range(self.groups)], dim=-1)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fmt={self.fmt}, block={self.block}, groups={self.groups}"


# From this many rows on, dequantizing the weight once and running cuBLAS beats the fused kernel
# (H200, 7168x7168 at 2,048 rows: fp8 kernel 260 TFLOP/s, bf16 F.linear 812; the dequantized copy
# costs one write of the weight, ~2% of such a matmul).
DEQUANTIZE_FROM_ROWS = 1024


def _matmul(x: torch.Tensor, weight: Packed) -> torch.Tensor:
    quant_linear = kernel("quant_linear", x)
    if quant_linear is not None and x.numel() // x.shape[-1] < DEQUANTIZE_FROM_ROWS:
        lead = x.shape[:-1]
        return quant_linear(x.reshape(-1, x.shape[-1]), weight).reshape(*lead, weight.out_features)
    return F.linear(x, weight.dequantize(x.dtype))
