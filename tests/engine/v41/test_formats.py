"""Weight formats (engine/quant): e8m0 scales, block FP8, MXFP4 — round trips and the reference decoder."""

from __future__ import annotations

import pytest
import torch

from engine.quant import (
    decode_e8m0,
    dequantize_fp8,
    dequantize_fp8_blocks,
    dequantize_fp8_rows,
    dequantize_mxfp4,
    encode_e8m0,
    power_of_two_ceil,
    quantize_fp8_blocks,
    quantize_fp8_rows,
    quantize_mxfp4,
)
from engine.quant.mxfp4 import pack_nibbles, round_to_e2m1, unpack_nibbles

E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6])


def generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_fp8(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Every e4m3 byte pattern is fair game, NaN (0x7f, 0xff) included."""
    return torch.randint(0, 256, (rows, cols), generator=generator(seed), dtype=torch.uint8).view(torch.float8_e4m3fn)


def random_e8m0(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Scales from 2**-127 (byte 0) to 2**127 (byte 254) and NaN (byte 255)."""
    raw = torch.randint(0, 256, (rows, cols), generator=generator(seed), dtype=torch.uint8)
    raw[0, 0], raw[-1, -1] = 0, 255
    return raw.view(torch.float8_e8m0fnu)


def assert_bit_equal(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    assert torch.equal(ours.isnan(), theirs.isnan())
    assert torch.equal(torch.nan_to_num(ours, nan=0.0), torch.nan_to_num(theirs, nan=0.0))


# ---- e8m0


def test_e8m0_decodes_every_byte_as_torch_does_and_encodes_back():
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ours = decode_e8m0(raw.view(torch.float8_e8m0fnu))
    assert_bit_equal(ours, raw.view(torch.float8_e8m0fnu).float())
    assert ours[127] == 1.0 and ours[128] == 2.0 and ours[0] == 2.0**-127 and ours[255].isnan()
    assert_bit_equal(decode_e8m0(raw), ours)  # the same bytes stored as uint8
    normal = ours[1:255]
    assert torch.equal(encode_e8m0(normal).view(torch.uint8), raw[1:255])
    with pytest.raises(ValueError):
        encode_e8m0(torch.tensor([3.0]))


def test_power_of_two_ceil_is_the_smallest_power_of_two_not_below():
    x = torch.cat([torch.rand(4000, generator=generator(1)) * 10.0 ** torch.randint(-30, 30, (4000,)),
                   2.0 ** torch.arange(-120, 120, dtype=torch.float32)])
    p = power_of_two_ceil(x)
    mantissa, _ = torch.frexp(p)
    assert (mantissa == 0.5).all() and (p >= x).all() and (p < 2 * x).all()
    assert torch.equal(power_of_two_ceil(2.0 ** torch.arange(-120, 120, dtype=torch.float32)),
                       2.0 ** torch.arange(-120, 120, dtype=torch.float32))


# ---- FP8 blocks


@pytest.mark.parametrize("block", [32, 128])
def test_fp8_block_round_trip_stays_within_one_e4m3_rounding(block):
    w = torch.randn(150, 200, generator=generator(2)) * torch.logspace(-3, 2, 200)  # partial edge blocks
    q, scale = quantize_fp8_blocks(w, block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (-(-150 // block), -(-200 // block))
    factors = decode_e8m0(scale).repeat_interleave(block, 0)[:150].repeat_interleave(block, 1)[:, :200]
    back = dequantize_fp8_blocks(q, scale, block, dtype=torch.float32)
    # half an e4m3 ulp: 2**-4 relative for normals, 2**-10 of the scale for subnormals
    assert ((back - w).abs() <= torch.maximum(w.abs() * 2.0**-4, factors * 2.0**-10)).all()
    # the ceil rule: each block's largest value lands in [224, 448] (after rounding), never clipped
    assert q.float().abs().max() <= 448
    padded = torch.zeros(-(-150 // block) * block, -(-200 // block) * block)
    padded[:150, :200] = q.float().abs()
    per_block = padded.unflatten(0, (-1, block)).unflatten(-1, (-1, block)).amax(dim=(1, 3))
    assert (per_block >= 224).all()


def test_fp8_rows_round_trip_and_scale_layout():
    table = torch.randn(1000, 64, generator=generator(3)) * torch.logspace(-4, 1, 1000)[:, None]
    q, scale = quantize_fp8_rows(table)
    assert scale.shape == (1000, 2) and scale.dtype == torch.float8_e8m0fnu
    back = dequantize_fp8_rows(q, scale, dtype=torch.float32)
    factors = decode_e8m0(scale).repeat_interleave(32, 1)
    assert ((back - table).abs() <= torch.maximum(table.abs() * 2.0**-4, factors * 2.0**-10)).all()


def test_zero_blocks_quantize_to_zero():
    w = torch.zeros(64, 64)
    w[40:, 40:] = torch.randn(24, 24, generator=generator(4))
    q, scale = quantize_fp8_blocks(w)
    back = dequantize_fp8_blocks(q, scale, dtype=torch.float32)
    assert (back[:32] == 0).all() and (back[:, :32] == 0).all()
    qm, sm = quantize_mxfp4(w)
    assert (dequantize_mxfp4(qm, sm, torch.float32)[:32, :32] == 0).all()


# ---- MXFP4


def test_e2m1_rounds_to_nearest_with_ties_to_the_even_code():
    values = torch.tensor([0.0, 0.24, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 6.0, -0.25, -0.3, -5.0, -6.0])
    codes = round_to_e2m1(values)
    assert codes.tolist() == [0, 0, 0, 1, 2, 2, 4, 4, 6, 6, 7, 7, 0, 9, 14, 15]
    # every representable value maps to its own code; random values to a nearest one
    assert torch.equal(round_to_e2m1(E2M1[:8]), torch.arange(8, dtype=torch.uint8))
    x = (torch.rand(10000, generator=generator(5)) * 12 - 6)
    decoded = E2M1[round_to_e2m1(x).long()]
    nearest = (x[:, None] - E2M1[None, :8].abs() * x.sign()[:, None]).abs().min(dim=1).values
    assert torch.equal((decoded - x).abs(), nearest)


def test_nibble_packing_puts_the_even_column_low():
    codes = torch.tensor([[1, 2, 15, 0, 7, 8]], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.dtype == torch.int8
    assert packed.view(torch.uint8).tolist() == [[0x21, 0x0F, 0x87]]
    assert torch.equal(unpack_nibbles(packed), codes)


def test_mxfp4_round_trip_stays_within_one_e2m1_rounding():
    w = torch.randn(48, 256, generator=generator(6)) * torch.logspace(-3, 1, 48)[:, None]
    packed, scale = quantize_mxfp4(w)
    assert packed.shape == (48, 128) and packed.dtype == torch.int8 and scale.shape == (48, 8)
    back = dequantize_mxfp4(packed, scale, torch.float32)
    factors = decode_e8m0(scale).repeat_interleave(32, 1)
    # e2m1 steps are 0.5 / 1 / 2 scale units below 2 / 4 / 6: at most half a step off
    step = torch.where(w.abs() < 2 * factors, 0.5, torch.where(w.abs() < 4 * factors, 1.0, 2.0)) * factors
    assert ((back - w).abs() <= step / 2).all()
    group_max = (back / factors).abs().unflatten(1, (8, 32)).amax(-1)
    assert (group_max > 3 - 1e-6).all() and (group_max <= 6).all()  # ceil rule: amax/scale in (3, 6]


# ---- the reference decoder (NeMo's dequantize_checkpoint_weight), on the same bytes


@pytest.fixture(scope="module")
def nemo_dequantize():
    reference = pytest.importorskip(
        "nemo_automodel.components.models.deepseek_v41.state_dict_adapter",
        reason="NeMo Automodel (the V4.1 reference) is a test-only dependency and is not installed",
    )
    return reference.dequantize_checkpoint_weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_32x32_blocks_decode_bit_exactly_like_the_reference(nemo_dequantize, dtype):
    weight, scale = random_fp8(100, 70, 10), random_e8m0(4, 3, 11)
    assert_bit_equal(dequantize_fp8_blocks(weight, scale, 32, dtype), nemo_dequantize(weight, scale, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engram_fp8_rows_decode_bit_exactly_like_the_reference(nemo_dequantize, dtype):
    weight, scale = random_fp8(300, 64, 12), random_e8m0(300, 2, 13)
    ours = dequantize_fp8_rows(weight, scale, dtype=dtype)
    assert_bit_equal(ours, nemo_dequantize(weight, scale, dtype=dtype, rowwise=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_decodes_bit_exactly_like_the_reference(nemo_dequantize, dtype):
    packed = torch.randint(-128, 128, (90, 48), generator=generator(14), dtype=torch.int8)
    scale = random_e8m0(90, 3, 15)
    assert_bit_equal(dequantize_mxfp4(packed, scale, dtype), nemo_dequantize(packed, scale, dtype=dtype))


def test_quantized_weights_decode_like_the_reference(nemo_dequantize):
    """Our encoder's output, read back by the reference decoder, gives our decoder's values."""
    w = torch.randn(96, 160, generator=generator(16))
    q, scale = quantize_fp8_blocks(w)
    assert_bit_equal(dequantize_fp8(q, scale, 32, 32, torch.float32), nemo_dequantize(q, scale, dtype=torch.float32))
    packed, scale = quantize_mxfp4(w)
    theirs = nemo_dequantize(packed, scale, dtype=torch.float32)
    assert_bit_equal(dequantize_mxfp4(packed, scale, torch.float32), theirs)


def test_v4_128_blocks_decode_like_the_v4_reference():
    v3 = pytest.importorskip("nemo_automodel.components.models.deepseek_v3.state_dict_adapter",
                             reason="NeMo Automodel (the V4 reference) is a test-only dependency")
    weight = random_fp8(300, 200, 17)
    weight = torch.where(weight.float().isnan(), torch.zeros((), dtype=torch.float8_e4m3fn), weight)
    scale = torch.full((3, 2), 120, dtype=torch.uint8).view(torch.float8_e8m0fnu)  # ordinary exponents
    scale.view(torch.uint8)[1, 0] = 131
    theirs = v3.dequantize_from_fp8(weight, scale, dtype=torch.float32, BLOCK_SIZE=128)
    assert_bit_equal(dequantize_fp8_blocks(weight, scale, 128, torch.float32), theirs)
