"""Weight formats of DeepSeek checkpoints: e8m0 scales, block FP8 (e4m3) and MXFP4 (e2m1), pure torch."""

from engine.quant.e8m0 import decode_e8m0, encode_e8m0, power_of_two_ceil
from engine.quant.fp8_blocks import (
    FP8_MAX,
    V4_BLOCK,
    V41_BLOCK,
    dequantize_fp8,
    dequantize_fp8_blocks,
    dequantize_fp8_rows,
    quantize_fp8,
    quantize_fp8_blocks,
    quantize_fp8_rows,
)
from engine.quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4

__all__ = [
    "FP8_MAX", "V4_BLOCK", "V41_BLOCK", "decode_e8m0", "dequantize_fp8", "dequantize_fp8_blocks",
    "dequantize_fp8_rows", "dequantize_mxfp4", "encode_e8m0", "power_of_two_ceil", "quantize_fp8",
    "quantize_fp8_blocks", "quantize_fp8_rows", "quantize_mxfp4",
]
