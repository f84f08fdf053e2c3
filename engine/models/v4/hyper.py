"""mHC hyper-connections: the residual is `hc_mult` streams [T, N, H] mixed around each block.

All parameters stay fp32; the mixing weights are computed in fp32 from the RMS-normed streams.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.dispatch import kernel
from engine.models.common.mhc import mix_matrix
from engine.models.common.norms import unweighted_rms_norm
from engine.models.v4.config import ModelConfig


class _GraphedMix:
    """`mix_matrix` on CUDA replayed from a CUDA graph per (token count, N, iters, eps).

    The eager version is ~120 tiny kernels (launch-bound at decode sizes); a replay is one launch
    plus the input and output copies, running the very same kernels (identical numerics). Only for
    small token counts (decode); anything that fails to capture falls back to eager for good.
    """

    MAX_TOKENS = 256
    MAX_GRAPHS = 64  # distinct token counts kept; later ones run eager

    def __init__(self):
        self.graphs: dict[tuple, tuple] = {}
        self.enabled = True

    def __call__(self, comb_logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        if (
            not self.enabled
            or comb_logits.device.type != "cuda"
            or comb_logits.shape[0] > self.MAX_TOKENS
            or torch.cuda.is_current_stream_capturing()
        ):
            return mix_matrix(comb_logits, iters, eps)
        key = (tuple(comb_logits.shape), comb_logits.dtype, comb_logits.device, iters, eps)
        entry = self.graphs.get(key)
        if entry is None:
            if len(self.graphs) >= self.MAX_GRAPHS:
                return mix_matrix(comb_logits, iters, eps)
            try:
                entry = self._capture(comb_logits, iters, eps)
            except Exception:  # noqa: BLE001 - any capture problem: stay eager
                self.enabled = False
                return mix_matrix(comb_logits, iters, eps)
            self.graphs[key] = entry
        graph, static_in, static_out = entry
        static_in.copy_(comb_logits)
        graph.replay()
        return static_out.clone()

    @staticmethod
    def _capture(comb_logits: torch.Tensor, iters: int, eps: float) -> tuple:
        static_in = comb_logits.clone()
        side = torch.cuda.Stream(device=comb_logits.device)
        side.wait_stream(torch.cuda.current_stream(comb_logits.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                mix_matrix(static_in, iters, eps)
        torch.cuda.current_stream(comb_logits.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            static_out = mix_matrix(static_in, iters, eps)
        static_in.copy_(comb_logits)
        graph.replay()
        if not torch.equal(static_out, mix_matrix(comb_logits, iters, eps)):
            raise RuntimeError("graphed mixing matrix differs from eager")
        return graph, static_in, static_out


_graphed_mix = _GraphedMix()


class HyperConnection(nn.Module):
    """Computes (post [T, N], comb [T, N, N], collapsed block input [T, H]) from the streams."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        n = config.hc_mult
        self.n = n
        self.iters = config.hc_sinkhorn_iters
        self.hc_eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * config.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if streams.dim() == 3 and (hc_v4_site := kernel("hc_v4_site", streams)) is not None:
            return hc_v4_site(streams, self.fn, self.base, self.scale, self.n, self.iters, self.hc_eps, self.norm_eps)
        n = self.n
        flat = unweighted_rms_norm(streams.flatten(-2).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb_logits = comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n)
        comb = _graphed_mix(comb_logits, self.iters, self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)
        return post, comb, collapsed


def merge_streams(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor):
    """New streams: post-weighted block output plus comb-mixed residual (out_k = sum_j comb[j, k] in_j)."""
    if (streams.dim() == 3 and block_out.shape == streams[:, 0].shape and block_out.dtype == streams.dtype
            and (hc_merge := kernel("hc_merge", streams)) is not None):
        return hc_merge(streams, block_out, post, comb, v41=False)
    dtype = streams.dtype
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + mixed


class HyperHead(nn.Module):
    """Final collapse of the streams into one hidden state before the last norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        n = config.hc_mult
        self.hc_eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.empty(n, n * config.hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        if streams.dim() == 3 and (hc_v4_head := kernel("hc_v4_head", streams)) is not None:
            return hc_v4_head(streams, self.hc_fn, self.hc_base, self.hc_scale, self.hc_eps, self.norm_eps)
        flat = unweighted_rms_norm(streams.flatten(-2).float(), self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)
