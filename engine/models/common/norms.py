"""RMS norms. Weighted norms keep an fp32 weight and compute in fp32, like the reference.

Where the kernel table says so (engine.kernels.dispatch), both take a fused Triton kernel with the same math.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.dispatch import kernel


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (rms_norm := kernel("rms_norm", x)) is not None:
            return rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    if (rms_norm := kernel("rms_norm", x)) is not None:
        return rms_norm(x, None, eps)
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
