"""Single-pass mHC: the residual is `hc_mult` streams [T, N, H]; each sublayer mixes them.

Every sublayer (attention site, FFN site) predicts fp32 coefficients from its input streams:
`pre` [T, N], `post` [T, N] and `comb` [T, N, N] (Sinkhorn-normalised). Unlike V4, a sublayer
collapses its streams with the *previous* sublayer's `pre` (the attention site with the last FFN
site's, the FFN site with its attention site's; block 0 uses a one-hot `pre` reading stream 0),
and the final hidden state is the collapse with the last FFN site's `pre` (no `hc_head`).
Parameters are the block's `hc_{site}_{fn,base,scale}`, kept in fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.dispatch import kernel
from engine.models.common.mhc import mix_matrix
from engine.models.v41.config import V41Config


class Mix(NamedTuple):
    pre: torch.Tensor  # [T, N] fp32
    post: torch.Tensor  # [T, N] fp32
    comb: torch.Tensor  # [T, N(in), N(out)] fp32


def register_site(module: nn.Module, site: str, config: V41Config) -> None:
    """Add the parameters `hc_{site}_fn / _base / _scale` (checkpoint names) to `module`."""
    n = config.hc_mult
    width = n * (n + 2)
    module.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.empty(width, n * config.hidden_size)))
    module.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros(width)))
    module.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3)))


def predict_mix(streams: torch.Tensor, fn, base, scale, config: V41Config) -> Mix:
    """Coefficients of one site from its input streams [T, N, H].

    The projection runs on the raw flattened streams and is scaled by their inverse RMS after
    (the release's order), and scale and base enter as one fused multiply-add.
    """
    if streams.dim() == 3 and (hc_v41_site := kernel("hc_v41_site", streams)) is not None:
        pre, post, comb, _ = hc_v41_site(streams, fn, base, scale, config.hc_mult, config.hc_sinkhorn_iters,
                                         config.hc_eps, config.rms_norm_eps)
        return Mix(pre, post, comb)
    n = config.hc_mult
    flat = streams.flatten(-2).float()
    inverse_rms = torch.rsqrt(flat.square().mean(-1, keepdim=True) + config.rms_norm_eps)
    mixes = F.linear(flat, fn.float()) * inverse_rms
    scales = torch.cat([scale[0].expand(n), scale[1].expand(n), scale[2].expand(n * n)]).float()
    logits = torch.addcmul(base.float(), mixes, scales)
    pre = torch.sigmoid(logits[..., :n]) + config.hc_eps
    post = 2 * torch.sigmoid(logits[..., n : 2 * n])
    comb = mix_matrix(logits[..., 2 * n :].unflatten(-1, (n, n)), config.hc_sinkhorn_iters, config.hc_eps)
    return Mix(pre, post, comb)


def first_pre(num_tokens: int, config: V41Config, device) -> torch.Tensor:
    """The `pre` block 0's attention site collapses with: all weight on stream 0."""
    pre = torch.zeros(num_tokens, config.hc_mult, device=device, dtype=torch.float32)
    pre[:, 0] = 1
    return pre


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """[T, N, H] streams weighted by `pre` [T, N] -> [T, H], summed in fp32."""
    if streams.dim() == 3 and (hc_collapse := kernel("hc_collapse", streams)) is not None:
        return hc_collapse(streams, pre)
    return (pre.unsqueeze(-1) * streams.float()).sum(-2).to(streams.dtype)


def expand(output: torch.Tensor, residual: torch.Tensor, mix: Mix) -> torch.Tensor:
    """New streams: stream k = post[k] * output + sum_j comb[j, k] * residual[j], in fp32."""
    if (residual.dim() == 3 and output.shape == residual[:, 0].shape
            and (hc_merge := kernel("hc_merge", residual)) is not None):
        return hc_merge(residual, output, mix.post, mix.comb, v41=True)
    update = mix.post.unsqueeze(-1) * output.unsqueeze(-2)
    mixed = (mix.comb.unsqueeze(-1) * residual.unsqueeze(-2)).sum(-3)
    return (update + mixed).to(output.dtype)


def mix_and_collapse(streams: torch.Tensor, pre: torch.Tensor, fn, base, scale,
                     config: V41Config) -> tuple[Mix, torch.Tensor]:
    """One site's `predict_mix(streams, ...)` and `collapse(streams, pre)` (pre: the previous
    site's); the kernel path reads the streams once for both."""
    if streams.dim() == 3 and (hc_v41_site := kernel("hc_v41_site", streams)) is not None:
        new_pre, post, comb, collapsed = hc_v41_site(streams, fn, base, scale, config.hc_mult,
                                                     config.hc_sinkhorn_iters, config.hc_eps,
                                                     config.rms_norm_eps, collapse_pre=pre)
        return Mix(new_pre, post, comb), collapsed
    return predict_mix(streams, fn, base, scale, config), collapse(streams, pre)
