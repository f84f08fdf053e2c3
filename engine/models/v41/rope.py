"""V4.1 rotary embeddings: adjacent channel pairs rotated as complex numbers.

Two flavours: SWA-only layers use `rope_theta` as is; every compressed layer (and the compressed
entries it reads) uses `compress_rope_theta` with YaRN that only rescales frequencies (unlike
V4's YaRN there is no attention-factor multiplier on cos/sin). The rotation is a complex multiply
in fp32, which is how the release rounds it; the result goes back to the input dtype.

Where the kernel table says so (engine.kernels.dispatch), the rotation (and a norm before it) runs as one Triton kernel
(engine.kernels.rope_norm), fed the same cos / sin torch.polar makes of the angles.
"""

from __future__ import annotations

import math

import torch

from engine.kernels.dispatch import kernel
from engine.models.common.norms import RMSNorm


def rope_frequencies(theta: float, rope_dim: int, scaling: dict | None = None) -> torch.Tensor:
    """Per-pair angular frequencies [rope_dim // 2] (fp32, CPU)."""
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32, device="cpu") / rope_dim  # never meta
    frequencies = 1.0 / (theta**exponents)
    original = int(scaling.get("original_max_position_embeddings", 0)) if scaling else 0
    if original <= 0:
        return frequencies
    factor = float(scaling.get("factor", 1.0))
    fast, slow = float(scaling.get("beta_fast", 32)), float(scaling.get("beta_slow", 1))

    def pair_for(rotations: float) -> float:  # the pair index that turns `rotations` times over `original`
        return rope_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(pair_for(fast)), 0)
    high = min(math.ceil(pair_for(slow)), rope_dim - 1)
    # 0 below `low` (keep the frequency), 1 above `high` (divide it by `factor`), linear between
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32, device="cpu") - low) / max(high - low, 1e-3)).clamp(0, 1)
    return frequencies / factor * ramp + frequencies * (1 - ramp)


class V41Rotary:
    """Angles for absolute positions, one flavour."""

    def __init__(self, theta: float, rope_dim: int, scaling: dict | None = None):
        self.rope_dim = rope_dim
        self.frequencies = rope_frequencies(theta, rope_dim, scaling)
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [...] (integers) -> fp32 angles [..., rope_dim // 2]."""
        frequencies = self._on_device.get(positions.device)
        if frequencies is None:
            frequencies = self._on_device.setdefault(positions.device, self.frequencies.to(positions.device))
        return positions.float().unsqueeze(-1) * frequencies


def apply_rope(values: torch.Tensor, angles: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing 2 * pairs channels of `values` [T, ..., D] by `angles` [T, pairs].

    Channels (2i, 2i+1) form the complex number c_i, which is multiplied by exp(+-1j * angle_i).
    Middle (head) axes broadcast. `inverse` undoes a rotation (used on the attention output).
    """
    if (rope := kernel("rope", values)) is not None:
        return rope(values, *_cos_sin(angles), inverse=inverse)
    width = 2 * angles.shape[-1]
    turn = torch.polar(torch.ones_like(angles), angles)
    while turn.dim() < values.dim():
        turn = turn.unsqueeze(-2)
    if inverse:
        turn = turn.conj()
    pairs = torch.view_as_complex(values[..., -width:].float().unflatten(-1, (-1, 2)).contiguous())
    rotated = torch.view_as_real(pairs * turn).flatten(-2).to(values.dtype)
    return torch.cat([values[..., :-width], rotated], dim=-1)


def _cos_sin(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The real and imaginary parts of the unit turns apply_rope multiplies by (fp32 views, no copy)."""
    turn = torch.view_as_real(torch.polar(torch.ones_like(angles), angles))
    return turn[..., 0], turn[..., 1]


def apply_rope_after_norm(values: torch.Tensor, norm: RMSNorm, angles: torch.Tensor) -> torch.Tensor:
    """apply_rope(norm(values), angles): one kernel (one read, one write) where kernels run."""
    if (norm_rope := kernel("norm_rope", values)) is not None:
        return norm_rope(values, norm.weight, norm.eps, *_cos_sin(angles))
    return apply_rope(norm(values), angles)
