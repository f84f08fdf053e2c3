"""KV compressors (CSA ratio 4 with overlapping windows, HCA ratio 128) and the lightning indexer.

A pooler turns every complete window of `ratio` tokens into one entry: a softmax over the window's
slots of (gate logit + position bias), per channel, weights the projected kv; then RMSNorm and RoPE
at the window's first position. CSA (`overlap=True`) projects two series per token: the first
half ("Ca") feeds the *next* window's entry, the second half ("Cb") the current one, so entry w
pools 2 * ratio slots (Ca of window w-1, Cb of window w).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.dispatch import load_kernel, takes_kernel
from engine.models.common.norms import RMSNorm
from engine.models.common.tail import PoolerTail
from engine.models.v4.config import ModelConfig
from engine.models.v4.rope import Rotary, apply_rope


class WindowPooler(nn.Module):
    def __init__(self, config: ModelConfig, head_dim: int, ratio: int, overlap: bool, rotary: Rotary):
        super().__init__()
        width = 2 * head_dim if overlap else head_dim
        self.head_dim, self.ratio, self.overlap = head_dim, ratio, overlap
        self.kv_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.gate_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.kv_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.rotary = rotary

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (kv, raw gate logits), each [T, width]."""
        return self.kv_proj(x), self.gate_proj(x)

    def pool(self, kv: torch.Tensor, gate: torch.Tensor, tail: PoolerTail, first_entry: int) -> torch.Tensor:
        """Append one sequence's new tokens to its tail; return the entries of the windows they complete.

        `first_entry` is the number of entries emitted so far (the next entry's index). Updates `tail`.
        """
        kv = torch.cat([tail.pending_kv, kv])
        gate = torch.cat([tail.pending_gate, gate])
        usable = kv.shape[0] // self.ratio * self.ratio
        if usable == 0:  # the cats above made fresh tensors: keep them as they are
            tail.pending_kv, tail.pending_gate = kv, gate
            return kv.new_empty(0, self.head_dim)
        tail.pending_kv, tail.pending_gate = kv[usable:].clone(), gate[usable:].clone()
        n_windows, m, d = usable // self.ratio, self.ratio, self.head_dim
        window_kv = kv[:usable].view(n_windows, m, -1)
        window_gate = gate[:usable].view(n_windows, m, -1) + self.position_bias
        if self.overlap:
            slot_kv, slot_gate = self._overlap_slots(window_kv, window_gate, tail)
            tail.overlap_kv = kv[usable - m : usable, :d].clone()
            tail.overlap_gate = gate[usable - m : usable, :d].clone()
        else:
            slot_kv, slot_gate = window_kv, window_gate
        return self._finish(slot_kv, slot_gate, (first_entry + torch.arange(n_windows, device=kv.device)) * m)

    def pool_windows(self, window_kv, window_gate, previous_kv, previous_gate, has_previous, starts) -> torch.Tensor:
        """One window per row, for a batch of sequences at once (decode): entries [B, head_dim].

        window_kv / window_gate [B, ratio, width]: the window's tokens in position order (raw gates);
        starts [B]: its first position. CSA also takes the window before it (previous_* [B, ratio,
        width], of which the first half is used) and has_previous [B] (False for window 0, which
        pools no predecessor, as `pool` does).
        """
        window_gate = window_gate + self.position_bias
        if not self.overlap:
            return self._finish(window_kv, window_gate, starts)
        d, keep = self.head_dim, has_previous[:, None, None]
        previous_kv = torch.where(keep, previous_kv[..., :d], 0)
        previous_gate = torch.where(keep, previous_gate[..., :d] + self.position_bias[:, :d], float("-inf"))
        slot_kv = torch.cat([previous_kv, window_kv[..., d:]], dim=1)
        slot_gate = torch.cat([previous_gate.to(window_gate.dtype), window_gate[..., d:]], dim=1)
        return self._finish(slot_kv, slot_gate, starts)

    def _finish(self, slot_kv: torch.Tensor, slot_gate: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """[n, slots, d] kv and biased gates -> n entries: gate-softmax pooling, RMSNorm, RoPE at `starts`."""
        weights = slot_gate.softmax(dim=1, dtype=torch.float32).to(slot_kv.dtype)
        pooled = self.kv_norm((slot_kv * weights).sum(dim=1))
        cos, sin = self.rotary.cos_sin(starts, pooled.dtype)
        return apply_rope(pooled, cos, sin)

    def _overlap_slots(self, window_kv, window_gate, tail: PoolerTail):
        """[n_windows, 2m, d] slots: Ca of the previous window, then Cb of this one."""
        m, d = self.ratio, self.head_dim
        if tail.overlap_kv is None:  # the very first window has no predecessor: weight 0
            first_kv = window_kv.new_zeros(1, m, d)
            first_gate = window_gate.new_full((1, m, d), float("-inf"))
        else:
            first_kv = tail.overlap_kv.to(window_kv.dtype)[None]
            first_gate = (tail.overlap_gate + self.position_bias[:, :d])[None].to(window_gate.dtype)
        previous_kv = torch.cat([first_kv, window_kv[:-1, :, :d]])
        previous_gate = torch.cat([first_gate, window_gate[:-1, :, :d]])
        slot_kv = torch.cat([previous_kv, window_kv[:, :, d:]], dim=1)
        slot_gate = torch.cat([previous_gate, window_gate[:, :, d:]], dim=1)
        return slot_kv, slot_gate


class IndexScorer(nn.Module):
    """score[t, s] = sum_h w[t, h] * ReLU(q[t, h] . k[s]) * index_head_dim^-0.5."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.softmax_scale = config.index_head_dim**-0.5
        self.weights_scaling = config.index_n_heads**-0.5
        self.weights_proj = nn.Linear(config.hidden_size, config.index_n_heads, bias=False)

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        return self.weights_proj(x).float() * self.weights_scaling

    def forward(self, q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor) -> torch.Tensor:
        """q [n, h, d], keys [E, d], head_weights [n, h] -> scores [n, E] (fp32).

        The head sum runs in fp64, where adding these fp32 terms is exact in any order, so equal
        terms give equal scores wherever the entry sits and however many queries run together.
        """
        scores = torch.relu(torch.matmul(q.float(), keys.float().t())) * self.softmax_scale
        return (scores * head_weights.unsqueeze(-1)).double().sum(dim=1).float()

    def batched(self, q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor) -> torch.Tensor:
        """`forward` for one query per sequence: q [B, h, d], keys [B, E, d], head_weights [B, h] -> [B, E]."""
        scores = torch.relu(torch.einsum("bhd,bed->bhe", q.float(), keys.float())) * self.softmax_scale
        return (scores * head_weights.unsqueeze(-1)).double().sum(dim=1).float()


class Indexer(WindowPooler):
    """Lightning indexer: its own overlapping compressor of small keys plus multi-head scoring."""

    def __init__(self, config: ModelConfig, rotary: Rotary):
        ratio = config.compress_rates["compressed_sparse_attention"]
        super().__init__(config, config.index_head_dim, ratio, overlap=True, rotary=rotary)
        self.n_heads, self.top_k = config.index_n_heads, config.index_topk
        self.q_b_proj = nn.Linear(config.q_lora_rank, config.index_n_heads * config.index_head_dim, bias=False)
        self.scorer = IndexScorer(config)

    def queries(self, q_residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = self.q_b_proj(q_residual).unflatten(-1, (self.n_heads, self.head_dim))
        return apply_rope(q, cos, sin)

    def select(self, q, head_weights, keys, positions) -> torch.Tensor:
        """Entries each query attends: the top-k visible by score, ties to the lower index. [n, E] bool.

        Entry w is visible to the query at position p iff (w + 1) * ratio <= p + 1.
        """
        entry = torch.arange(keys.shape[0], device=keys.device)
        visible = entry[None, :] < ((positions + 1) // self.ratio)[:, None]
        if keys.shape[0] <= self.top_k:
            return visible
        if takes_kernel("index_scores", q):
            scores = self._fused_scores(q, head_weights, keys, (positions + 1) // self.ratio)
        else:
            scores = self.scorer(q, keys, head_weights).masked_fill(~visible, float("-inf"))
        # A stable descending sort keeps equal scores in index order: deterministic for any shape.
        chosen = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, : self.top_k]
        selected = torch.zeros_like(visible).scatter_(1, chosen, True)
        return selected & visible

    def select_batched(self, q, head_weights, keys, visible: torch.Tensor, scored: bool) -> torch.Tensor:
        """`select` for one query per sequence: keys [B, E, d] padded, visible [B, E] -> [B, E] bool.
        `scored` False (no sequence sees more than top_k entries): every visible entry."""
        if not scored:
            return visible
        if takes_kernel("index_scores", q):
            scores = self._fused_scores(q, head_weights, keys, visible.sum(dim=1))  # visible: a prefix
        else:
            scores = self.scorer.batched(q, keys, head_weights).masked_fill(~visible, float("-inf"))
        chosen = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, : self.top_k]
        return torch.zeros_like(visible).scatter_(1, chosen, True) & visible

    def top_k_indices(self, q, head_weights, keys, visible_count: torch.Tensor) -> torch.Tensor:
        """The kernel path's `select` as a list: the entries each query attends, [n, top_k] int32, -1 for
        none. keys [E, d] shared or [n, E, d] per query (E > top_k); query i sees entries [0, count[i]).
        The same choice as `select` (stable sort: equal scores keep the lower index); no host syncs."""
        scores = self._fused_scores(q, head_weights, keys, visible_count)
        chosen = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, : self.top_k]
        return torch.where(chosen < visible_count[:, None], chosen, -1).to(torch.int32)

    def _fused_scores(self, q, head_weights, keys, visible_count: torch.Tensor) -> torch.Tensor:
        """`IndexScorer` by one fused kernel: [n, E] fp32, -inf where not visible."""
        return load_kernel("index_scores")(q, head_weights, keys, self.scorer.softmax_scale, visible_count)
