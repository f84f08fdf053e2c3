"""Weight-only quantized matmul in Triton: y = x @ W^T with W read in its packed format.

Weights stay in their checkpoint format (`engine.quant.packed.Packed`: fp8 e4m3 with e8m0 block
scales, mxfp4 with one e8m0 scale per row and 32 columns, or plain bf16) and are decoded tile by
tile in registers, so a decode step streams the packed bytes once. `accumulate_tile` is the shared
decode-and-dot step; the mixture-of-experts kernels (`engine.kernels.moe_gemm`) use it too.

Rounding: the decoded weight is exact in the activation dtype (e4m3 and e2m1 times a power of two),
products accumulate in fp32 and the result is cast once, as F.linear(x, W.dequantize(x.dtype)) does;
only the summation order differs. FP8 scales multiply each K tile's partial dot (exact: powers of
two), so an fp8 K tile never spans two scale blocks. Scale bytes 0 and 255 (which `pack` never
writes) decode to 0 and inf here, not 2**-127 and NaN.

For few rows (decode) the K range is split across programs so the whole GPU streams weight bytes;
the fp32 partials add up in a fixed order (deterministic: no atomics).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.kernels import interpreting
from engine.quant.packed import Packed

FMT_BF16, FMT_FP8, FMT_MXFP4 = 0, 1, 2
FMT_CODES = {"bf16": FMT_BF16, "fp8": FMT_FP8, "mxfp4": FMT_MXFP4}
MX_GROUP = 32
# Decode tiles could multiply weight x activation^T (the decoded weight as wgmma's register operand).
# Measured on an H200 (Triton 3.6) it was 5-20% slower for fp8 and even for mxfp4, so it is off;
# kept as a switch (tested) for other chips and Triton versions.
SWAP_AB = False


@triton.jit
def e8m0_factor(byte, extra_exponent: tl.constexpr):
    """fp32 2**(byte - 127 + extra_exponent), built from exponent bits (exact)."""
    return ((byte.to(tl.int32) + extra_exponent) << 23).to(tl.float32, bitcast=True)


@triton.jit
def cast(x, dtype: tl.constexpr, RNE_BY_HAND: tl.constexpr):
    """fp32 x in dtype, rounded to nearest even. RNE_BY_HAND: round bf16 in integer arithmetic first
    (Triton's CPU interpreter truncates fp32 -> bf16; compiled code rounds to nearest even)."""
    if RNE_BY_HAND and dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def decode_mxfp4(packed, BN: tl.constexpr, BK: tl.constexpr):
    """[BN, BK // 2] int8 bytes -> [BN, BK] fp32 e2m1 values times 2**-14 (column 2k = low nibble).

    Each nibble's exponent and mantissa bits go into fp16's exponent and mantissa (the sign to bit
    15): fp16 then reads the e2m1 value scaled by 2**-14, subnormal 0.5 included.
    """
    raw = packed.to(tl.uint8, bitcast=True)
    codes = tl.reshape(tl.join(raw & 0xF, raw >> 4), (BN, BK))
    bits = ((codes & 7).to(tl.int16) << 9) | ((codes & 8).to(tl.int16) << 12)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _mma(a, weight, SWAP: tl.constexpr, PRECISION: tl.constexpr):
    """a [BM, BK] @ weight [BN, BK]^T as [BM, BN]; SWAP: its transpose [BN, BM], the weight on the
    MMA's wide M side (few activation rows: Hopper's wgmma then takes the decoded weight from registers)."""
    if SWAP:
        out = tl.dot(weight, tl.trans(a), input_precision=PRECISION)
    else:
        out = tl.dot(a, tl.trans(weight), input_precision=PRECISION)
    return out


@triton.jit
def accumulate_tile(
    acc, a, data_ptr, scale_ptr, rows, row_ok, k0, K,
    stride_dn, stride_sn, stride_sk, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
    FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr, SWAP: tl.constexpr,
):
    """acc [BM, BN] (SWAP: [BN, BM]) + a [BM, BK] @ W[rows, k0:k0+BK]^T, the weight tile decoded in registers.

    data_ptr/scale_ptr point at one matrix (an expert's already added); K is its input features.
    FP8 needs BK to divide the scale block's columns (SCALE_COLS), MXFP4 BK a multiple of 32.
    """
    rows64 = rows.to(tl.int64)
    if FMT == 2:  # mxfp4: bytes hold two columns, one scale per row and 32 columns
        cols = k0 // 2 + tl.arange(0, BK // 2)
        packed = tl.load(data_ptr + rows64[:, None] * stride_dn + cols[None, :],
                         mask=row_ok[:, None] & (cols < K // 2)[None, :], other=0)
        groups = k0 // 32 + tl.arange(0, BK // 32)
        scale = tl.load(scale_ptr + rows64[:, None] * stride_sn + groups[None, :] * stride_sk,
                        mask=row_ok[:, None] & (groups < K // 32)[None, :], other=0)
        factor = e8m0_factor(scale, 14)  # undoes decode_mxfp4's 2**-14
        factor = tl.reshape(tl.broadcast_to(factor[:, :, None], (BN, BK // 32, 32)), (BN, BK))
        weight = (decode_mxfp4(packed, BN, BK) * factor).to(a.dtype)
        acc += _mma(a, weight, SWAP, PRECISION)
    else:
        cols = k0 + tl.arange(0, BK)
        weight = tl.load(data_ptr + rows64[:, None] * stride_dn + cols[None, :],
                         mask=row_ok[:, None] & (cols < K)[None, :], other=0)
        if FMT == 1:  # fp8 arrives as bytes (a masked fp8 load cannot take other=0 everywhere)
            weight = weight.to(tl.float8e4nv, bitcast=True)
        partial = _mma(a, weight.to(a.dtype), SWAP, PRECISION)
        if FMT == 1:  # fp8: this K tile sits in one scale column; the factor varies per row block
            scale = tl.load(scale_ptr + (rows64 // SCALE_ROWS) * stride_sn + (k0 // SCALE_COLS) * stride_sk,
                            mask=row_ok & (k0 < K), other=127)
            factor = e8m0_factor(scale, 0)
            if SWAP:
                partial = partial * factor[:, None]
            else:
                partial = partial * factor[None, :]
        acc += partial
    return acc


def mma_in_fp32(dtype: torch.dtype) -> bool:
    """Multiply in fp32: fp32 activations, and everything under the CPU interpreter (whose bf16 dot
    multiplies the raw bit patterns as integers; fp32 products of bf16 values are exact anyway)."""
    return dtype == torch.float32 or interpreting()


def rne_by_hand() -> bool:
    """`cast` rounds bf16 itself only under the interpreter, which would truncate."""
    return interpreting()


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 operands multiply in full fp32 (tf32 would miss the reference by far)."""
    return "ieee" if mma_in_fp32(dtype) else "tf32"


def weight_args(weight: Packed) -> dict:
    """The kernel arguments describing one Packed (a matrix or an expert stack)."""
    if weight.fmt not in FMT_CODES:
        raise ValueError(f"unknown weight format {weight.fmt!r}")
    if weight.data.stride(-1) != 1:
        raise ValueError("packed weight rows must be contiguous")
    rows, cols = weight.block
    if weight.fmt == "fp8" and (cols & (cols - 1) or cols < 16):
        raise ValueError(f"fp8 scale blocks need power-of-two columns >= 16, got {weight.block}")
    scale = weight.data if weight.scale is None else weight.scale  # bf16: a never-read placeholder
    strides = (0, 0, 0) if weight.scale is None else (0, 0, 0, *scale.stride())[-3:]
    data = weight.data.view(torch.uint8) if weight.fmt == "fp8" else weight.data
    return dict(
        data=data, scale=scale, fmt=FMT_CODES[weight.fmt], scale_rows=rows, scale_cols=cols,
        stride_de=weight.data.stride(0) if weight.data.dim() == 3 else 0, stride_dn=weight.data.stride(-2),
        stride_se=strides[0], stride_sn=strides[1], stride_sk=strides[2],
    )


def k_tile(weight: Packed, wanted: int) -> int:
    """The K tile: fp8 tiles stay inside one scale block, mxfp4 tiles cover whole 32-column groups."""
    if weight.fmt == "fp8":
        return min(wanted, weight.block[1])
    if weight.fmt == "mxfp4":
        return max(wanted, MX_GROUP)
    return wanted


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors to fill (a nominal 8 on the CPU interpreter)."""
    if device.type != "cuda":
        return 8
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def _quant_linear_kernel(
    x_ptr, data_ptr, scale_ptr, out_ptr, T, N, K: tl.constexpr, stride_xt, stride_dn, stride_sn, stride_sk,
    stride_os, stride_ot, K_PER_SPLIT: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
    FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
    MMA_FP32: tl.constexpr, RNE_BY_HAND: tl.constexpr, SWAP: tl.constexpr,
):
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = pid_m * BM + tl.arange(0, BM)
    n = pid_n * BN + tl.arange(0, BN)
    m_ok, n_ok = m < T, n < N
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    k_begin = pid_s * K_PER_SPLIT
    for step in range(0, K_PER_SPLIT, BK):  # the last split's tiles past K load nothing
        k0 = k_begin + step
        cols = k0 + tl.arange(0, BK)
        a = tl.load(x_ptr + m.to(tl.int64)[:, None] * stride_xt + cols[None, :],
                    mask=m_ok[:, None] & (cols < K)[None, :], other=0)
        if MMA_FP32:
            a = a.to(tl.float32)
        acc = accumulate_tile(acc, a, data_ptr, scale_ptr, n, n_ok, k0, K, stride_dn, stride_sn, stride_sk,
                              SCALE_ROWS, SCALE_COLS, FMT, BN, BK, PRECISION, SWAP)
    if SWAP:
        acc = tl.trans(acc)
    out = out_ptr + pid_s.to(tl.int64) * stride_os + m.to(tl.int64)[:, None] * stride_ot + n[None, :]
    tl.store(out, cast(acc, out_ptr.dtype.element_ty, RNE_BY_HAND), mask=m_ok[:, None] & n_ok[None, :])


def _linear_tiles(n_rows: int, weight: Packed) -> tuple[int, int, int, int]:
    """(BM, BN, BK, num_warps): decode streams weights in narrow tiles; prefill uses wide MMA tiles."""
    if n_rows <= 64:
        return max(16, triton.next_power_of_2(n_rows)), 64, k_tile(weight, 128), 4
    return 64 if n_rows <= 256 else 128, 128, k_tile(weight, 64), 8


def _split_count(programs: int, k_tiles: int, device: torch.device) -> int:
    """K splits that give about two programs per SM, each keeping at least 4 K tiles of work."""
    wanted = -(-2 * sm_count(device) // max(programs, 1))
    return max(1, min(wanted, k_tiles // 4))


def quant_linear(
    x: torch.Tensor, weight: Packed, out_dtype: torch.dtype | None = None, split_k: int | None = None
) -> torch.Tensor:
    """x [T, K] @ weight^T -> [T, N] in out_dtype (default x.dtype), the weight decoded in registers.

    K and the split length are compile-time constants (model dimensions: a few variants, and
    loops over them stay runnable under the CPU interpreter).

    `weight` is one matrix: data [N, K] (fp8, bf16) or [N, K / 2] (mxfp4). `split_k` forces the
    number of K splits (tests); by default decode-sized T splits K to fill the GPU.
    """
    if x.dim() != 2 or weight.data.dim() != 2 or x.shape[1] != weight.in_features:
        raise ValueError(f"quant_linear takes x [T, K] and a 2-D weight, got {tuple(x.shape)} and {weight.data.shape}")
    out_dtype = out_dtype or x.dtype
    x = x.contiguous()
    (n_rows, k_in), n_out = x.shape, weight.out_features
    args = weight_args(weight)
    bm, bn, bk, warps = _linear_tiles(n_rows, weight)
    grid_mn = triton.cdiv(n_rows, bm), triton.cdiv(n_out, bn)
    k_tiles = triton.cdiv(k_in, bk)
    splits = split_k or (_split_count(grid_mn[0] * grid_mn[1], k_tiles, x.device) if n_rows <= 64 else 1)
    splits = max(1, min(splits, k_tiles))
    k_per_split = triton.cdiv(k_tiles, splits) * bk
    splits = triton.cdiv(k_in, k_per_split)  # no empty split
    if splits == 1:
        out = torch.empty(n_rows, n_out, device=x.device, dtype=out_dtype)
    else:
        out = torch.empty(splits, n_rows, n_out, device=x.device, dtype=torch.float32)
    _quant_linear_kernel[(*grid_mn, splits)](
        x, args["data"], args["scale"], out, n_rows, n_out, k_in, x.stride(0), args["stride_dn"],
        args["stride_sn"], args["stride_sk"], n_rows * n_out, n_out, k_per_split, args["scale_rows"],
        args["scale_cols"], FMT=args["fmt"], BM=bm, BN=bn, BK=bk, PRECISION=dot_precision(x.dtype),
        MMA_FP32=mma_in_fp32(x.dtype), RNE_BY_HAND=rne_by_hand(),
        SWAP=SWAP_AB and n_rows <= 64, num_warps=warps, num_stages=4 if n_rows <= 64 else 3,
    )
    if splits == 1:
        return out
    return out.sum(dim=0).to(out_dtype)  # a fixed-order reduction: deterministic


def quant_linear_reference(x: torch.Tensor, weight: Packed, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Plain torch: F.linear with the weight dequantized to x's dtype."""
    out = torch.nn.functional.linear(x, weight.dequantize(x.dtype))
    return out if out_dtype is None else out.to(out_dtype)
