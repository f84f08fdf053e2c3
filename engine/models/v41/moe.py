"""V4.1 mixture of experts: score routing for every layer (no hash layers), one shared expert.

The gate scores in fp32 (sqrt(softplus(logits))); a text token chooses its experts by
score + `bias`, an image token by score + `bias_vl`. The chosen scores are renormalised (unless
`norm_topk_prob` is false) and
scaled by `routed_scaling_factor`. Experts are clamped SwiGLUs computed in fp32; a routed
expert's weight multiplies its activation before the down projection, and routed outputs add
up in fp32. Module and parameter names are the released checkpoint's (`w1` gate, `w3` up,
`w2` down).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.dispatch import kernel
from engine.models.common.activations import clamped_swiglu
from engine.models.spec import PackableExperts
from engine.quant.packed import Packed, pack_stack
from engine.models.v41.config import V41Config


class Expert(nn.Module):
    def __init__(self, config: V41Config):
        super().__init__()
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)
        self.limit = config.swiglu_limit

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 clamped SwiGLU: gate clamped above, up clamped both ways."""
        return clamped_swiglu(self.w1(x).float(), self.w3(x).float(), self.limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.activation(x).to(x.dtype))


class Gate(nn.Module):
    def __init__(self, config: V41Config):
        super().__init__()
        self.top_k = config.experts_per_token
        self.scaling = config.routed_scaling_factor
        self.normalize = config.norm_topk_prob
        if config.scoring_func != "sqrtsoftplus":
            raise ValueError(f"V4.1 routes with sqrtsoftplus, not {config.scoring_func!r}")
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.register_buffer("bias", torch.zeros(config.n_routed_experts, dtype=torch.float32))
        self.register_buffer("bias_vl", torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] fp32, expert ids [T, k])."""
        scores = F.softplus(F.linear(x.float(), self.weight.float())).sqrt()
        bias = self.bias.float().expand_as(scores)
        if image_mask is not None:
            bias = torch.where(image_mask[:, None], self.bias_vl.float(), bias)
        experts = torch.topk(scores + bias, self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.normalize and self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, experts


class MoE(PackableExperts):
    def __init__(self, config: V41Config):
        super().__init__()
        self.gate = Gate(config)
        self.experts = nn.ModuleList(Expert(config) for _ in range(config.n_routed_experts))
        self.shared_experts = Expert(config)
        self.limit = config.swiglu_limit

    def expert_weights(self) -> list[torch.Tensor]:
        """The plain routed-expert weights (empty once packed)."""
        return [w for e in self.experts for w in (e.w1.weight, e.w2.weight, e.w3.weight)]

    def pack_(self, fmt: str, block: int = 32) -> None:
        """Hold the routed experts stacked in `fmt` (the release: mxfp4) and drop the per-expert modules."""
        count = len(self.experts)
        with torch.no_grad():  # expert by expert: a stacked bf16 copy of a layer's experts is ~17 GiB
            gate_up = pack_stack((torch.cat([e.w1.weight, e.w3.weight]) for e in self.experts), count, fmt, block)
            down = pack_stack((e.w2.weight for e in self.experts), count, fmt, block)
        self.experts = nn.ModuleList()
        for name, packed in (("gate_up", gate_up), ("down", down)):
            self.register_buffer(f"{name}_data", packed.data)
            self.register_buffer(f"{name}_scale", packed.scale)
        self.fmt, self.block = fmt, gate_up.block

    def stacked(self) -> tuple[Packed, Packed]:
        """(gate_up [E, 2I, H], down [E, H, I]) as held after `pack_` (buffers, so they follow .to())."""
        return (Packed(self.fmt, self.gate_up_data, self.gate_up_scale, self.block),
                Packed(self.fmt, self.down_data, self.down_scale, self.block))

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        weights, experts = self.gate(x, image_mask)
        if len(self.experts) == 0:  # packed by pack_
            return self._packed(x, weights, experts) + self.shared_experts(x)
        return self._loop(x, weights, experts, len(self.experts),
                          lambda e, rows, w: self.experts[e].w2((self.experts[e].activation(rows) * w).to(x.dtype))
                          ) + self.shared_experts(x)

    def _loop(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, n_experts: int, run) -> torch.Tensor:
        """Routed outputs summed in fp32, expert by expert; run(e, rows, w) gives expert e's output
        for its token rows, w being their routing weights [n, 1] (applied before the down projection)."""
        routed = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=n_experts).tolist()
        token_of, slot_weight = order // experts.shape[1], weights.flatten()[order]
        start = 0
        for expert, count in enumerate(counts):
            if count:
                tokens, w = token_of[start : start + count], slot_weight[start : start + count, None]
                routed.index_add_(0, tokens, run(expert, x[tokens], w).float())
                start += count
        return routed.to(x.dtype)

    def _packed(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.stacked()
        if (moe_forward := kernel("moe", x)) is not None:
            return moe_forward(x, weights, experts, gate_up, down, self.limit, v41=True)
        inter = gate_up.out_features // 2

        def run(expert: int, rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # dequantized per call (CPU)
            gate, up = F.linear(rows, gate_up.expert(expert).dequantize(x.dtype)).float().split(inter, dim=-1)
            hidden = (clamped_swiglu(gate, up, self.limit) * w).to(x.dtype)
            return F.linear(hidden, down.expert(expert).dequantize(x.dtype))

        return self._loop(x, weights, experts, gate_up.data.shape[0], run)
