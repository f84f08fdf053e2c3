"""MXFP4: e2m1 values packed two per byte with one e8m0 scale per row and 32 columns.

The packed matrix is int8 [rows, cols / 2]: column 2k sits in the low nibble of byte k, column
2k+1 in the high nibble. A nibble is sign (bit 3) and a 3-bit magnitude code for
0, 0.5, 1, 1.5, 2, 3, 4, 6. Scales are float8_e8m0fnu [rows, cols / 32].
"""

from __future__ import annotations

import torch

from engine.quant.e8m0 import block_scale, decode_e8m0, encode_e8m0

FP4_MAX = 6.0
GROUP = 32
MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
CHUNK_ELEMENTS = 1 << 22


def _code_values(device) -> torch.Tensor:
    """float32 value of each of the 16 nibbles (the sign bit set on +0 decodes as 0)."""
    magnitudes = torch.tensor(MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([magnitudes, -magnitudes])


def round_to_e2m1(values: torch.Tensor) -> torch.Tensor:
    """uint8 nibble codes of float32 values already within [-6, 6]: nearest, ties to the even code.

    The magnitudes are three evenly spaced ranges (step 0.5 below 2, 1 up to 4, 2 up to 6), so each
    range is one half-to-even `round`; every subtraction and halving here is exact in float32.
    """
    m = values.abs()
    upper = torch.where(m < 4, 4 + torch.round(m - 2), 6 + torch.round((m - 4) / 2))
    code = torch.where(m < 2, torch.round(2 * m), upper)
    magnitude = code.to(torch.uint8)
    negative = (values < 0) & (magnitude > 0)  # -0 is written as +0
    return magnitude | (negative.to(torch.uint8) << 3)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """int8 [rows, cols/2] from uint8 codes [rows, cols]: even column low, odd column high."""
    if codes.shape[-1] % 2:
        raise ValueError("MXFP4 packing needs an even number of columns")
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(torch.int8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 codes [rows, 2 * packed cols] of an int8 (or uint8) packed matrix."""
    raw = packed.view(torch.uint8)
    codes = torch.stack([raw & 0x0F, raw >> 4], dim=-1)
    return codes.flatten(-2)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [rows, cols/2], float8_e8m0fnu [rows, cols/32]) for a matrix whose columns divide by 32."""
    if weight.ndim != 2 or weight.shape[1] % GROUP:
        raise ValueError(f"MXFP4 takes a matrix with a multiple of {GROUP} columns, got {tuple(weight.shape)}")
    rows, columns = weight.shape
    groups = weight.float().view(rows, columns // GROUP, GROUP)
    scale = block_scale(groups.abs().amax(dim=-1), FP4_MAX)
    normalized = (groups / scale.unsqueeze(-1)).clamp_(-FP4_MAX, FP4_MAX).view(rows, columns)
    return pack_nibbles(round_to_e2m1(normalized)), encode_e8m0(scale)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[rows, 2 * packed cols] in `dtype`, decoded a row range at a time."""
    if packed.dtype not in (torch.int8, torch.uint8) or packed.ndim != 2:
        raise TypeError(f"expected a packed int8 matrix, got {packed.dtype} {tuple(packed.shape)}")
    rows, columns = packed.shape[0], packed.shape[1] * 2
    if tuple(scale.shape) != (rows, -(-columns // GROUP)):
        raise ValueError(f"scale shape {tuple(scale.shape)} != {(rows, -(-columns // GROUP))}")
    table = _code_values(packed.device)
    factors = decode_e8m0(scale)
    out = torch.empty(rows, columns, dtype=dtype, device=packed.device)
    step = max(1, CHUNK_ELEMENTS // max(columns, 1))
    for begin in range(0, rows, step):
        end = min(rows, begin + step)
        values = table[unpack_nibbles(packed[begin:end]).long()]
        out[begin:end] = values * factors[begin:end].repeat_interleave(GROUP, dim=1)[:, :columns]
    return out
