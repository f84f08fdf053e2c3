"""Weight-only quantized matmul (engine.kernels.quant_linear) against F.linear on the dequantized
weight: every format, odd N and K, decode sizes (split K) and a prefill size."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need Triton (the `gpu` extra); CI installs without it")

from engine.kernels.quant_linear import quant_linear, quant_linear_reference
from engine.quant.packed import pack

N_OUT = 100  # no multiple of any N tile


def _weight(fmt: str, block: int, k_in: int, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(N_OUT, k_in, generator=gen) * 0.05
    return pack(weight.bfloat16() if fmt == "bf16" else weight, fmt, block).to(device)


def _x(n_tokens: int, k_in: int, dtype, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randn(n_tokens, k_in, generator=gen).to(device=device, dtype=dtype)


def _assert_close(out, ref):
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:  # one bf16 rounding of an fp32 sum taken in another order: at most an ulp apart
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 * 2.0**-8, atol=1e-3)


FORMATS = [("fp8", 128, 300), ("fp8", 32, 300), ("mxfp4", 32, 288), ("bf16", 1, 300)]  # fmt, block, K


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt,block,k_in", FORMATS)
@pytest.mark.parametrize("n_tokens,split_k", [(1, None), (37, 3), (70, None)])
def test_quant_linear_matches_reference(device, fmt, block, k_in, dtype, n_tokens, split_k):
    weight, x = _weight(fmt, block, k_in, device), _x(n_tokens, k_in, dtype, device)
    out = quant_linear(x, weight, split_k=split_k)
    assert out.dtype == dtype and out.shape == (n_tokens, N_OUT)
    _assert_close(out, quant_linear_reference(x, weight))


def test_split_k_is_deterministic_and_agrees(device):
    weight, x = _weight("mxfp4", 32, 288, device), _x(3, 288, torch.bfloat16, device)
    split = quant_linear(x, weight, split_k=4)
    assert torch.equal(split, quant_linear(x, weight, split_k=4))
    _assert_close(split, quant_linear(x, weight, split_k=1))


def test_out_dtype(device):
    weight, x = _weight("fp8", 128, 300, device), _x(5, 300, torch.bfloat16, device)
    out = quant_linear(x, weight, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    # the fp32 sum is not rounded through bf16 on its way out
    torch.testing.assert_close(out, quant_linear_reference(x.float(), weight), rtol=1e-5, atol=1e-5)


def test_rejects_mismatched_shapes(device):
    weight = _weight("fp8", 128, 300, device)
    with pytest.raises(ValueError):
        quant_linear(_x(2, 256, torch.float32, device), weight)


@pytest.mark.parametrize("fmt,block,k_in", [("fp8", 32, 300), ("mxfp4", 32, 288)])
def test_swapped_operands(device, monkeypatch, fmt, block, k_in):
    """The weight x activation^T variant for decode sizes (SWAP_AB) matches the reference too."""
    monkeypatch.setattr("engine.kernels.quant_linear.SWAP_AB", True)
    weight, x = _weight(fmt, block, k_in, device), _x(7, k_in, torch.bfloat16, device)
    _assert_close(quant_linear(x, weight, split_k=2), quant_linear_reference(x, weight))
