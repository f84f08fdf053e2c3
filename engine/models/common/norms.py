"""RMS norms. Weighted norms keep an fp32 weight and compute in fp32, like the reference.

Where `use_kernels` says so, both take a fused Triton kernel (engine.kernels.rope_norm) with the same math.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels import use_kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_kernels(x):
            from engine.kernels.rope_norm import rms_norm  # Triton: imported only where kernels run

            return rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    if use_kernels(x):
        from engine.kernels.rope_norm import rms_norm

        return rms_norm(x, None, eps)
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
