"""FP8 (e4m3) matrices with one e8m0 scale per block of rows x columns.

Three grids occur in DeepSeek checkpoints: square 32x32 blocks (V4.1 linears), square 128x128
blocks (V4 linears) and one row by 32 columns (V4.1 Engram tables). The scale tensor has shape
[ceil(rows / row_block), ceil(columns / col_block)]; edge blocks are partial.
"""

from __future__ import annotations

import torch

from engine.quant.e8m0 import block_scale, decode_e8m0, encode_e8m0

FP8_MAX = 448.0  # largest finite float8_e4m3fn
V41_BLOCK = 32
V4_BLOCK = 128
ROW_GROUP = 32  # Engram tables: per row, per 32 columns
CHUNK_ELEMENTS = 1 << 22  # bounds the float32 temporaries of a decode


def scale_shape(rows: int, columns: int, row_block: int, col_block: int) -> tuple[int, int]:
    return -(-rows // row_block), -(-columns // col_block)


def quantize_fp8(weight: torch.Tensor, row_block: int, col_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [rows, cols], float8_e8m0fnu scales) for a 2-D weight; rounding is to nearest even."""
    if weight.ndim != 2:
        raise ValueError(f"FP8 block quantization takes a matrix, got shape {tuple(weight.shape)}")
    rows, columns = weight.shape
    grid_rows, grid_cols = scale_shape(rows, columns, row_block, col_block)
    padded = torch.zeros(grid_rows * row_block, grid_cols * col_block, dtype=torch.float32, device=weight.device)
    padded[:rows, :columns] = weight
    blocks = padded.view(grid_rows, row_block, grid_cols, col_block)
    scale = block_scale(blocks.abs().amax(dim=(1, 3)), FP8_MAX)
    scaled = (blocks / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
    quantized = scaled.view(padded.shape)[:rows, :columns].to(torch.float8_e4m3fn)
    return quantized.contiguous(), encode_e8m0(scale)


def dequantize_fp8(
    weight: torch.Tensor,
    scale: torch.Tensor,
    row_block: int,
    col_block: int,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """[rows, cols] in `dtype`: each e4m3 value times its block's scale, decoded a row range at a time."""
    if weight.dtype != torch.float8_e4m3fn or weight.ndim != 2:
        raise TypeError(f"expected a float8_e4m3fn matrix, got {weight.dtype} {tuple(weight.shape)}")
    rows, columns = weight.shape
    expected = scale_shape(rows, columns, row_block, col_block)
    if tuple(scale.shape) != expected:
        raise ValueError(f"scale shape {tuple(scale.shape)} != {expected} for a {rows}x{columns} matrix")
    factors = decode_e8m0(scale)
    out = torch.empty(rows, columns, dtype=dtype, device=weight.device)
    step = max(row_block, CHUNK_ELEMENTS // max(columns, 1) // row_block * row_block)
    for begin in range(0, rows, step):
        end = min(rows, begin + step)
        block_rows = factors[begin // row_block : -(-end // row_block)]
        expanded = block_rows.repeat_interleave(row_block, dim=0)[: end - begin]
        expanded = expanded.repeat_interleave(col_block, dim=1)[:, :columns]
        out[begin:end] = weight[begin:end].float() * expanded
    return out


def quantize_fp8_blocks(weight: torch.Tensor, block: int = V41_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Square blocks: 32 for V4.1 linears, 128 for V4."""
    return quantize_fp8(weight, block, block)


def dequantize_fp8_blocks(
    weight: torch.Tensor, scale: torch.Tensor, block: int = V41_BLOCK, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    return dequantize_fp8(weight, scale, block, block, dtype)


def quantize_fp8_rows(table: torch.Tensor, group: int = ROW_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Engram tables: scales [rows, cols / 32]."""
    return quantize_fp8(table, 1, group)


def dequantize_fp8_rows(
    table: torch.Tensor, scale: torch.Tensor, group: int = ROW_GROUP, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    return dequantize_fp8(table, scale, 1, group, dtype)
