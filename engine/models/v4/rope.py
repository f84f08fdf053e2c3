"""Partial, interleaved rotary embeddings (plain RoPE and YaRN) applied to the last `rope_dim` channels.

Where the kernel table says so (engine.kernels.dispatch), rotation (and a norm before it) runs as one Triton kernel
(engine.kernels.rope_norm) with the same fp32 math: no torch.cat.
"""

from __future__ import annotations

import math

import torch

from engine.kernels.dispatch import kernel
from engine.models.common.norms import RMSNorm, unweighted_rms_norm
from engine.models.v4.config import RopeSpec


def inverse_frequencies(spec: RopeSpec, rope_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [rope_dim // 2] fp32, cos/sin scaling) for one rope flavour."""
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32, device="cpu") / rope_dim
    if spec.rope_type == "default":
        return 1.0 / (spec.theta**exponents), 1.0
    factor = spec.factor
    if factor is None:
        factor = max_position_embeddings / spec.original_max_position_embeddings
    scaling = spec.attention_factor
    if scaling is None:
        if spec.mscale and spec.mscale_all_dim:
            scaling = _yarn_mscale(factor, spec.mscale) / _yarn_mscale(factor, spec.mscale_all_dim)
        else:
            scaling = _yarn_mscale(factor, 1.0)
    pos_freqs = spec.theta**exponents
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    low, high = _correction_range(spec, rope_dim)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # share of each pair that keeps its original (extrapolated) frequency
    return interpolation * (1 - keep) + extrapolation * keep, float(scaling)


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _correction_range(spec: RopeSpec, rope_dim: int) -> tuple[float, float]:
    def dim_for(rotations: float) -> float:
        span = spec.original_max_position_embeddings / (rotations * 2 * math.pi)
        return rope_dim * math.log(span) / (2 * math.log(spec.theta))

    low = math.floor(dim_for(spec.beta_fast))
    high = math.ceil(dim_for(spec.beta_slow))
    return max(low, 0), min(high, rope_dim - 1)


class Rotary:
    """cos/sin tables for one rope flavour, computed on the fly for absolute positions."""

    def __init__(self, spec: RopeSpec, rope_dim: int, max_position_embeddings: int):
        self.rope_dim = rope_dim
        self.inv_freq, self.scaling = inverse_frequencies(spec, rope_dim, max_position_embeddings)
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] -> cos, sin [..., rope_dim // 2] in `dtype` (as the reference rounds them)."""
        inv_freq = self._on_device.get(positions.device)
        if inv_freq is None:
            inv_freq = self._on_device.setdefault(positions.device, self.inv_freq.to(positions.device))
        freqs = positions[..., None].float() * inv_freq
        return (freqs.cos() * self.scaling).to(dtype), (freqs.sin() * self.scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive channel pairs of the trailing rope slice of `x` [T, ..., D].

    cos / sin are [T, rope_dim // 2] and broadcast over the middle (head) axes.
    Pass `-sin` to undo a rotation.
    """
    if (rope := kernel("rope", x)) is not None:
        return rope(x, cos, sin)
    rope_dim = 2 * cos.shape[-1]
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rope = x[..., -rope_dim:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    cos, sin = cos.float(), sin.float()
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([x[..., :-rope_dim], rotated.to(x.dtype)], dim=-1)


def apply_rope_after_norm(x: torch.Tensor, norm: RMSNorm, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope(norm(x), cos, sin): one kernel (one read, one write of x) where kernels run."""
    if (norm_rope := kernel("norm_rope", x)) is not None:
        return norm_rope(x, norm.weight, norm.eps, cos, sin)
    return apply_rope(norm(x), cos, sin)


def apply_rope_after_unweighted_norm(x: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope(unweighted_rms_norm(x, eps), cos, sin), the norm per head of x [T, H, D]; one kernel
    where kernels run."""
    if (norm_rope := kernel("norm_rope", x)) is not None:
        return norm_rope(x, None, eps, cos, sin)
    return apply_rope(unweighted_rms_norm(x, eps), cos, sin)
