"""E8M0 scales: a bare 8-bit exponent, value 2**(byte - 127); byte 255 is NaN and there is no zero.

Checkpoints store them as `float8_e8m0fnu` (some loaders view the same bytes as uint8). Scales are
powers of two rounded UP from amax / qmax, so dividing a block by its scale never leaves the
element format's range (the release's rule; OCP MX's floor rule would clip the largest values).
"""

from __future__ import annotations

import torch

E8M0_BIAS = 127
_MANTISSA_BITS = 23
_MANTISSA_MASK = (1 << _MANTISSA_BITS) - 1
_MIN_NORMAL = 2.0**-126  # smallest scale we produce: keeps every encoded byte in [1, 254]
_NAN_BITS = 0x7FC00000


def exponent_bytes(scale: torch.Tensor) -> torch.Tensor:
    """The raw uint8 bytes of an e8m0 tensor (stored as float8_e8m0fnu or uint8)."""
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8)
    if scale.dtype != torch.uint8:
        raise TypeError(f"e8m0 scales are float8_e8m0fnu or uint8, got {scale.dtype}")
    return scale


def decode_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """float32 values 2**(byte-127); byte 0 is the subnormal 2**-127, byte 255 NaN."""
    raw = exponent_bytes(scale).to(torch.int32)
    bits = torch.where(raw == 0, torch.full_like(raw, 1 << (_MANTISSA_BITS - 1)), raw << _MANTISSA_BITS)
    bits = torch.where(raw == 255, torch.full_like(raw, _NAN_BITS), bits)
    return bits.view(torch.float32)


def encode_e8m0(powers_of_two: torch.Tensor) -> torch.Tensor:
    """float8_e8m0fnu bytes for positive normal float32 powers of two (anything else is an error)."""
    bits = powers_of_two.float().contiguous().view(torch.int32)
    exponent = (bits >> _MANTISSA_BITS) & 0xFF
    if bool(((bits & _MANTISSA_MASK) != 0).any() | (exponent == 0).any() | (exponent == 255).any() | (bits < 0).any()):
        raise ValueError("e8m0 encodes positive normal powers of two only")
    return exponent.to(torch.uint8).view(torch.float8_e8m0fnu)


def power_of_two_ceil(value: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= value, for positive float32 (raised to 2**-126 first)."""
    bits = value.float().clamp_min(_MIN_NORMAL).contiguous().view(torch.int32)
    exponent = (bits >> _MANTISSA_BITS) & 0xFF
    exponent = exponent + ((bits & _MANTISSA_MASK) != 0).to(torch.int32)
    return (exponent << _MANTISSA_BITS).view(torch.float32)


def block_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """float32 power-of-two scale per block: ceil to a power of two of amax * (1 / qmax)."""
    return power_of_two_ceil(amax.float() * (1.0 / qmax))
