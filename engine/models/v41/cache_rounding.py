"""The rounding the released V4.1 caches apply, simulated in floating point.

The release stores its caches in small formats; a value read back from a cache is the stored value
dequantized. Our caches keep the model dtype, so every value goes through the same round trip
at the point where the release writes it:

- SWA KV (every layer's window): fp8 e4m3 over all channels, blocks of 32, power-of-two scales.
- Compressed KV (KV sources): nvfp4, blocks of 16, e4m3 scales.
- Indexer queries and keys: mxfp4, blocks of 32, power-of-two (e8m0) scales.

Each block of channels shares a scale taken from its largest magnitude; fp4 values are e2m1
(+-{0, .5, 1, 1.5, 2, 3, 4, 6}), rounded to nearest with ties to the even grid point. The
arithmetic (constants, divisions) follows the reference exactly: a value near a rounding
boundary must land on the same side.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SWA_KV = ("fp8", 32)
COMPRESSED_KV = ("nvfp4", 16)
INDEX_QK = ("mxfp4", 32)

_FP4_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def round_cache(values: torch.Tensor, point: tuple[str, int]) -> torch.Tensor:
    """Round [..., channels] through the format of a cache point (`SWA_KV`, ...); same shape and dtype."""
    fmt, block = point
    channels = values.shape[-1]
    blocks = F.pad(values.float(), (0, -channels % block)).unflatten(-1, (-1, block))
    peak = blocks.abs().amax(-1, keepdim=True)
    if fmt == "fp8":
        scale = _power_of_two_at_least(peak.clamp_min(1e-4) * (1 / 448))
        rounded = (blocks / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    elif fmt in ("nvfp4", "mxfp4"):
        if fmt == "nvfp4":
            scale = (peak.clamp_min(6 * 2**-9) / 6).to(torch.float8_e4m3fn).float()
        else:
            scale = _power_of_two_at_least(peak.clamp_min(6 * 2**-126) * (1 / 6))
        rounded = _round_fp4((blocks / scale).clamp(-6, 6))
    else:
        raise ValueError(f"unknown cache format {fmt!r}")
    return (rounded * scale).flatten(-2)[..., :channels].to(values.dtype)


def _power_of_two_at_least(value: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= each positive normal fp32 value (exact, no logarithms)."""
    mantissa, exponent = torch.frexp(value)  # value = mantissa * 2**exponent, mantissa in [0.5, 1)
    power = torch.ldexp(torch.ones_like(value), exponent)
    return torch.where(mantissa == 0.5, value, power)


def _round_fp4(x: torch.Tensor) -> torch.Tensor:
    """Round values in [-6, 6] to the nearest e2m1 value; a tie goes to the even grid index."""
    grid = torch.tensor(_FP4_GRID, dtype=torch.float32, device=x.device)
    magnitude = x.abs()
    below = (torch.bucketize(magnitude, grid, right=True) - 1).clamp(0, len(_FP4_GRID) - 2)
    low, high = grid[below], grid[below + 1]
    middle = (low + high) / 2
    up = (magnitude > middle) | ((magnitude == middle) & (below % 2 == 1))
    return torch.copysign(torch.where(up, high, low), x)
