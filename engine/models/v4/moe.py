"""Mixture of experts: hash-routed or top-k routed experts plus a shared expert, SwiGLU with clamping."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.dispatch import kernel
from engine.models.common.activations import clamped_swiglu
from engine.models.spec import PackableExperts
from engine.models.v4.config import HASH_MOE, ModelConfig
from engine.quant.packed import Packed, pack


def score_experts(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)


class SharedExpert(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.limit = config.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class Router(nn.Module):
    """Expert choice: a frozen token->experts table (hash) or top-k of biased scores."""

    def __init__(self, config: ModelConfig, hashed: bool):
        super().__init__()
        self.hashed = hashed
        self.top_k = config.experts_per_token
        self.scoring_func = config.scoring_func
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k], expert ids [T, k])."""
        scores = score_experts(F.linear(x, self.weight), self.scoring_func)
        if self.hashed:
            experts = self.tid2eid[input_ids].long()
        else:
            experts = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, experts


class RoutedExperts(PackableExperts):
    """Expert weights stored stacked, as in the HF checkpoint layout."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        n, hidden, inter = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.n_experts = n
        self.limit = config.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(n, hidden, inter))

    def expert_weights(self) -> list[torch.Tensor]:
        """The plain expert weights (empty once packed)."""
        return [self.gate_up_proj, self.down_proj] if "gate_up_proj" in self._parameters else []

    def pack_(self, fmt: str, block: int = 128) -> None:
        """Keep the expert weights in `fmt` (engine.quant.packed) from now on; frees the bf16 copies."""
        with torch.no_grad():
            gate_up, down = pack(self.gate_up_proj.detach(), fmt, block), pack(self.down_proj.detach(), fmt, block)
        del self.gate_up_proj, self.down_proj
        self.fmt, self.block = fmt, gate_up.block
        for name, packed in (("gate_up", gate_up), ("down", down)):
            self.register_buffer(f"{name}_data", packed.data)
            self.register_buffer(f"{name}_scale", packed.scale)

    @property
    def packed(self) -> tuple[Packed, Packed] | None:
        """(gate_up, down) as held: packed after `pack_`, else the bf16 parameters viewed as Packed."""
        if "gate_up_proj" in self._parameters:
            return Packed("bf16", self.gate_up_proj, None, (1, 1)), Packed("bf16", self.down_proj, None, (1, 1))
        return (Packed(self.fmt, self.gate_up_data, self.gate_up_scale, self.block),
                Packed(self.fmt, self.down_data, self.down_scale, self.block))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        plain = "gate_up_proj" in self._parameters
        moe_forward = kernel("moe", x)
        if moe_forward is not None and not (plain and x.shape[0] * experts.shape[1] > KERNEL_SLOTS_PLAIN):
            gate_up, down = self.packed
            return moe_forward(x, weights, experts, gate_up, down, self.limit, v41=False)
        if "gate_up_proj" not in self._parameters:
            return self._looped(x, weights, experts)
        if _grouped_mm_ok(x, self.gate_up_proj):
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                return self._grouped(x, weights, experts)  # no fallback while a graph captures: it would sync
            try:
                return self._grouped(x, weights, experts)
            except RuntimeError:  # a grouped-matmul kernel refusing these shapes: loop from now on
                _GROUPED_MM_FAILED.add(x.device.type)
        return self._looped(x, weights, experts)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """All experts in two grouped matmuls over the expert-sorted token slots: no host sync (so it
        can be captured in a CUDA graph).

        Rounding as the per-expert loop: each slot's weighted output is cast to the activation
        dtype, and a token's k outputs add up in that dtype in ascending expert order.
        """
        n_tokens, k = experts.shape
        flat_experts = experts.flatten()
        order = torch.argsort(flat_experts, stable=True)
        # group ends: slots with expert <= e. (bincount would read its input's max on the host: a sync)
        experts_ids = torch.arange(self.n_experts, device=x.device, dtype=flat_experts.dtype)
        offs = torch.searchsorted(flat_experts[order], experts_ids, right=True).to(torch.int32)
        xs = x[order // k]
        gate, up = _grouped_mm(xs, self.gate_up_proj.transpose(-1, -2), offs).chunk(2, dim=-1)
        y = _grouped_mm(clamped_swiglu(gate, up, self.limit), self.down_proj.transpose(-1, -2), offs)
        slots = torch.empty(n_tokens * k, y.shape[-1], device=y.device, dtype=x.dtype)
        slots[order] = (y * weights.flatten()[order, None]).to(x.dtype)
        by_expert = experts.argsort(dim=1, stable=True)  # each token's slots in ascending expert order
        slots = slots.view(n_tokens, k, -1).gather(1, by_expert[:, :, None].expand(-1, -1, slots.shape[-1]))
        out = slots[:, 0]
        for j in range(1, k):
            out = out + slots[:, j]
        return out

    def _looped(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        flat_experts = experts.flatten()
        order = torch.argsort(flat_experts, stable=True)
        counts = torch.bincount(flat_experts, minlength=self.n_experts).tolist()
        token_of = order // experts.shape[1]
        slot_weight = weights.flatten()[order]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            tokens = token_of[start : start + count]
            gate_up, down = self._expert_weights(expert, x.dtype)
            gate, up = F.linear(x[tokens], gate_up).chunk(2, dim=-1)
            y = F.linear(clamped_swiglu(gate, up, self.limit), down)
            out.index_add_(0, tokens, (y * slot_weight[start : start + count, None]).to(out.dtype))
            start += count
        return out


    def _expert_weights(self, expert: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert's (gate_up, down) matrices, dequantized when the weights are packed."""
        if "gate_up_proj" in self._parameters:
            return self.gate_up_proj[expert], self.down_proj[expert]
        return tuple(p.expert(expert).dequantize(dtype) for p in self.packed)


# bf16 experts: the fused kernel for decode-sized batches (it streams the weights at ~4.3 TB/s where
# grouped_mm reached 3.3), torch's grouped_mm for prefill-sized ones (a higher matrix rate).
KERNEL_SLOTS_PLAIN = 1024

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_GROUPED_MM_FAILED: set[str] = set()


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _GROUPED_MM(a.to(b.dtype), b, offs=offs)


def _grouped_mm_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Grouped matmul on CPU (any float dtype) or on a CUDA GPU of compute capability 8+ in bf16."""
    if _GROUPED_MM is None or x.dtype != weight.dtype or x.device.type in _GROUPED_MM_FAILED:
        return False
    if weight.device.type == "cpu":
        return True
    if weight.device.type == "cuda":
        return weight.dtype == torch.bfloat16 and _capability(weight.device) >= (9, 0)
    return False


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


class MoE(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.gate = Router(config, hashed=config.mlp_layer_types[layer] == HASH_MOE)
        self.experts = RoutedExperts(config)
        self.shared_experts = SharedExpert(config)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x, input_ids)
        return self.experts(x, weights, experts) + self.shared_experts(x)
