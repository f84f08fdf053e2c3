"""The KV source's compressor: the unrotated latent of each compressed entry.

Ratio r > 1 pools non-overlapping groups of r tokens (entry w covers positions [w*r, (w+1)*r)):
per channel, a softmax over the group's gate logits weights the projected values, all in fp32,
then RMSNorm. Ratio 1 is a projection plus RMSNorm (one entry per token). There is no position
bias and no overlap with the previous group (both were V4's).

Tokens of an unfinished group wait in the state's tail (`PoolerTail.pending_kv/pending_gate`,
kept in fp32 as projected) until the group completes, so a chunked prefill or a decode pools
exactly the groups a whole-sequence forward would.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.common.norms import RMSNorm
from engine.models.common.tail import PoolerTail
from engine.models.v41.config import V41Config


class LatentCompressor(nn.Module):
    def __init__(self, config: V41Config, ratio: int):
        super().__init__()
        self.ratio = ratio
        self.head_dim = config.head_dim
        self.wkv = nn.Linear(config.hidden_size, config.head_dim, bias=False, dtype=torch.float32)
        if ratio > 1:
            self.wgate = nn.Linear(config.hidden_size, config.head_dim, bias=False, dtype=torch.float32)
        self.norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def project(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-token inputs of the compressor, for the packed tokens of a batch [T, hidden]."""
        if self.ratio == 1:  # ratio 1 projects in the activation dtype and is already an entry
            return {"latent": self.norm(F.linear(x, self.wkv.weight.to(x.dtype)))}
        x32 = x.float()
        return {"kv": F.linear(x32, self.wkv.weight.float()), "gate": F.linear(x32, self.wgate.weight.float())}

    def pool(self, span: dict[str, torch.Tensor], tail: PoolerTail | None, dtype: torch.dtype) -> torch.Tensor:
        """One sequence's new tokens (after those in `tail`) -> latents of the groups they complete
        [n, head_dim] in `dtype`. Updates `tail` in place to the tokens still waiting."""
        if self.ratio == 1:
            return span["latent"]
        kv = torch.cat([tail.pending_kv.float(), span["kv"]])
        gate = torch.cat([tail.pending_gate.float(), span["gate"]])
        usable = kv.shape[0] // self.ratio * self.ratio
        tail.pending_kv, tail.pending_gate = kv[usable:].clone(), gate[usable:].clone()
        if usable == 0:
            return kv.new_empty(0, self.head_dim, dtype=dtype)
        groups_kv = kv[:usable].unflatten(0, (-1, self.ratio))
        weights = gate[:usable].unflatten(0, (-1, self.ratio)).softmax(dim=1)
        return self.norm((groups_kv * weights).sum(dim=1).to(dtype))
