"""Fused RMSNorm / rotary kernels (engine.kernels.rope_norm) against the model's torch functions.

Rope is the same arithmetic as torch, so on a GPU it must be bit-exact in every dtype. Norms sum
a row in another order, so their fp32 scale may differ in the last place: fp32 tight, bf16 within
one ulp and almost always equal. Triton's CPU interpreter rounds fp32 -> bf16 by truncation (the
GPU rounds to nearest even), so there bf16 results may be one ulp further off.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.kernels import kernel_mode
from engine.models.common.norms import RMSNorm, unweighted_rms_norm
from engine.models.v4.rope import apply_rope, apply_rope_after_norm, apply_rope_after_unweighted_norm
from engine.models.v41 import rope as v41_rope

EPS = 1e-6
ROPE_DIM = 64
BF16_ULP = 2.0**-7  # the largest relative spacing of bf16 numbers


def kernels():
    from engine.kernels import rope_norm  # needs Triton: imported once the device fixture found it

    return rope_norm


def tables(t: int, pairs: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin of random angles, rounded to `dtype` as Rotary.cos_sin rounds them."""
    angles = torch.rand(t, pairs, device=device) * 2 * math.pi
    return angles.cos().to(dtype), angles.sin().to(dtype)


def make_x(shape, dtype, device) -> torch.Tensor:
    return (torch.randn(shape, device=device) * 3 + 0.5).to(dtype)


def assert_rope_equal(out: torch.Tensor, ref: torch.Tensor, device) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if ref.dtype == torch.float32 or device.type == "cuda":
        assert torch.equal(out, ref), (out.float() - ref.float()).abs().max()
    else:
        torch.testing.assert_close(out, ref, rtol=BF16_ULP, atol=1e-6)


def assert_norm_close(out: torch.Tensor, ref: torch.Tensor, device, unweighted: bool = False,
                      rotated: bool = False) -> None:
    """`rotated`: a rotation after the norm subtracts products, so a last-place difference in its
    input is an absolute error on the scale of the row, not of each (possibly tiny) result."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    magnitude = ref.abs().max().item() if rotated else 0.0
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=4e-6, atol=1e-6 + 4e-7 * magnitude)
        return
    # the unweighted norm rounds its scale to bf16 too: one more ulp where the interpreter truncates
    ulps = 1 if device.type == "cuda" else (3 if unweighted else 2)
    torch.testing.assert_close(out, ref, rtol=ulps * BF16_ULP, atol=1e-6 + ulps * BF16_ULP * magnitude)
    if device.type == "cuda":  # a last-place difference in the fp32 scale rarely moves a bf16 result
        assert (out != ref).float().mean().item() < 0.01


SHAPES = [(t, *heads, d) for t in (1, 7, 300) for heads in ((), (3,)) for d in (64, 512, 576)]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_the_module_and_the_unweighted_norm(device, shape, dtype):
    torch.manual_seed(0)
    x = make_x(shape, dtype, device)
    norm = RMSNorm(shape[-1], EPS).to(device)
    norm.weight.data = torch.rand(shape[-1], device=device) + 0.5
    with kernel_mode("off"):
        weighted, unweighted = norm(x), unweighted_rms_norm(x, EPS)
    assert_norm_close(kernels().rms_norm(x, norm.weight, EPS), weighted, device)
    assert_norm_close(kernels().rms_norm(x, None, EPS), unweighted, device, unweighted=True)


@pytest.mark.parametrize("d", [28672, 8193])  # the hyper-connection streams (4 x 7168): rows wider than one block
def test_wide_rows_loop_over_chunks(device, d):
    torch.manual_seed(1)
    x = make_x((3, d), torch.float32, device)
    weight = torch.rand(d, device=device) + 0.5
    with kernel_mode("off"):
        reference = unweighted_rms_norm(x, EPS)
        norm = RMSNorm(d, EPS).to(device)
        norm.weight.data = weight
        weighted = norm(x)
    assert_norm_close(kernels().rms_norm(x, None, EPS), reference, device)
    assert_norm_close(kernels().rms_norm(x, weight, EPS), weighted, device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rope_matches_apply_rope(device, shape, dtype):
    torch.manual_seed(2)
    x = make_x(shape, dtype, device)
    cos, sin = tables(shape[0], ROPE_DIM // 2, dtype, device)
    with kernel_mode("off"):
        forward, backward = apply_rope(x, cos, sin), apply_rope(x, cos, -sin)
    assert_rope_equal(kernels().rope(x, cos, sin), forward, device)
    assert_rope_equal(kernels().rope(x, cos, sin, inverse=True), backward, device)


@pytest.mark.parametrize("shape", [(7, 576), (7, 3, 512), (300, 64)])
def test_inverse_rope_undoes_rope(device, shape):
    torch.manual_seed(3)
    x = make_x(shape, torch.float32, device)
    cos, sin = tables(shape[0], ROPE_DIM // 2, torch.float32, device)
    turned = kernels().rope(x, cos, sin)
    assert not torch.allclose(turned[..., -ROPE_DIM:], x[..., -ROPE_DIM:])
    torch.testing.assert_close(kernels().rope(turned, cos, sin, inverse=True), x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_layouts_callers_pass(device, dtype):
    """Strided token / head axes (slices of a wider buffer), several middle axes, a transposed last
    axis, an odd number of pairs, no untouched channels, and cos / sin views with a pair stride."""
    torch.manual_seed(4)
    cos, sin = tables(5, ROPE_DIM // 2, dtype, device)
    wide = make_x((5, 4, 600), dtype, device)
    cases = [
        (wide[:, 1:, :576], cos, sin),  # token stride 2400, head stride 600
        (make_x((5, 2, 3, 96), dtype, device), cos, sin),
        (make_x((5, 96, 3), dtype, device).transpose(1, 2), cos, sin),  # last axis not unit-stride
        (make_x((5, 2, 40), dtype, device), cos[:, :12], sin[:, :12]),  # 12 pairs: not a power of two
        (make_x((5, 2, 64), dtype, device), cos, sin),  # every channel rotates
        (make_x((5, 2, 96), dtype, device), *tables(5, 64, dtype, device)[0].unflatten(-1, (32, 2)).unbind(-1)),
    ]
    for x, c, s in cases:
        with kernel_mode("off"):
            reference = apply_rope(x, c, s)
        out = kernels().rope(x, c, s)
        assert out.is_contiguous()
        assert_rope_equal(out, reference, device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 512), (7, 576), (300, 64), (1, 3, 512), (7, 3, 576), (300, 3, 64)])
def test_norm_rope_matches_norm_then_rope(device, shape, dtype):
    torch.manual_seed(5)
    x = make_x(shape, dtype, device)
    cos, sin = tables(shape[0], ROPE_DIM // 2, dtype, device)
    norm = RMSNorm(shape[-1], EPS).to(device)
    norm.weight.data = torch.rand(shape[-1], device=device) + 0.5
    with kernel_mode("off"):
        weighted = apply_rope(norm(x), cos, sin)
        unweighted = apply_rope(unweighted_rms_norm(x, EPS), cos, sin)
    assert_norm_close(kernels().norm_rope(x, norm.weight, EPS, cos, sin), weighted, device, rotated=True)
    assert_norm_close(kernels().norm_rope(x, None, EPS, cos, sin), unweighted, device, unweighted=True, rotated=True)


def test_empty_batches(device):
    x = torch.empty(0, 3, 576, device=device)
    cos = torch.empty(0, ROPE_DIM // 2, device=device)
    assert kernels().rope(x, cos, cos).shape == x.shape
    assert kernels().rms_norm(x, None, EPS).shape == x.shape
    assert kernels().norm_rope(x, None, EPS, cos, cos).shape == x.shape


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inverse", [False, True])
def test_v41_rope_dispatch_matches_the_complex_multiply(device, dtype, inverse):
    """V4.1 multiplies complex numbers; torch may fuse that multiply-add, so within an fp32 ulp."""
    torch.manual_seed(6)
    x = make_x((7, 3, 512), dtype, device)
    angles = torch.arange(7, device=device, dtype=torch.float32)[:, None] * torch.rand(32, device=device)
    with kernel_mode("off"):
        reference = v41_rope.apply_rope(x, angles, inverse=inverse)
    out = v41_rope.apply_rope(x, angles, inverse=inverse)  # the device fixture turned kernels on
    if dtype == torch.float32:
        torch.testing.assert_close(out, reference, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(out, reference, rtol=BF16_ULP, atol=1e-6)
    assert torch.equal(out[..., :-64], x[..., :-64])


def test_model_norm_rope_helpers_dispatch(device):
    torch.manual_seed(7)
    q, kv = make_x((7, 3, 64), torch.float32, device), make_x((7, 64), torch.float32, device)
    cos, sin = tables(7, 16, torch.float32, device)
    norm = RMSNorm(64, EPS).to(device)
    norm.weight.data = torch.rand(64, device=device) + 0.5
    angles = torch.rand(7, 16, device=device) * 6
    calls = {
        "v4 weighted": lambda: apply_rope_after_norm(kv, norm, cos, sin),
        "v4 unweighted": lambda: apply_rope_after_unweighted_norm(q, EPS, cos, sin),
        "v41 weighted": lambda: v41_rope.apply_rope_after_norm(kv, norm, angles),
    }
    for name, call in calls.items():
        with kernel_mode("off"):
            reference = call()
        torch.testing.assert_close(call(), reference, rtol=4e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("config", ["tiny", "tiny-v41"])
def test_tiny_model_logits_with_and_without_kernels(device, tmp_path, config):
    """Every norm and rope of a random tiny model through the kernels: logits as the torch path's."""
    from engine.loading import load_model
    from engine.models.v4.random_init import write_random_model_dir
    from engine.models.v41.random_init import write_random_v41_model_dir
    from tests.engine.references import TEST_VOCAB, make_prompt

    if config == "tiny":
        model_dir = write_random_model_dir(config, tmp_path, seed=0, vocab_size=TEST_VOCAB, dtype=torch.float32)
    else:
        model_dir = write_random_v41_model_dir(config, tmp_path, seed=0, vocab_size=TEST_VOCAB)
    model = load_model(model_dir, device=device, dtype=torch.float32)
    prompt = make_prompt(19, 0).to(device)
    logits = {}
    for mode in ("off", "on" if device.type == "cpu" else "auto"):
        with kernel_mode(mode):
            state = model.new_state()
            prefill = model([prompt], [state], all_logits=True)
            step = model([prompt[-1:]], [state])  # one decode step on top of it
            logits[mode] = torch.cat([prefill, step])
    reference, ours = logits.values()
    scale = reference.abs().max()
    assert (ours - reference).abs().max() <= 1e-4 * scale
