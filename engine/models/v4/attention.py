"""V4 attention: shared-KV MQA over [sliding window | compressed entries] with per-head sinks.

Projections run on the packed tokens of the whole batch; the compressors and the attention core
run per sequence against that sequence's explicit state, or, for a decode step of paged states,
batched over the sequences (`_attend_decode_batch`).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.dispatch import kernel, load_kernel, takes_kernel
from engine.models.common.attention_math import sink_softmax, window_mask
from engine.models.common.linear import GroupedLinear
from engine.models.common.norms import RMSNorm
from engine.models.spec import SequenceKV
from engine.models.v4.batch import ForwardBatch
from engine.models.v4.compressor import Indexer, WindowPooler
from engine.models.v4.config import CSA, HCA, SLIDING, ModelConfig
from engine.models.v4.rope import Rotary, apply_rope, apply_rope_after_norm, apply_rope_after_unweighted_norm

QUERY_BLOCK = 256  # queries per attention block: bounds the score tensor for long prefills
SCORE_ELEMENTS = 1 << 24  # the kernel path's indexer scores per chunk of queries (64 MiB of fp32)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, rotaries: dict[str, Rotary]):
        super().__init__()
        self.layer = layer
        self.layer_type = config.layer_types[layer]
        self.rope_flavour = "main" if self.layer_type == SLIDING else "compress"
        self.n_heads, self.head_dim = config.num_heads, config.head_dim
        self.window = config.sliding_window
        self.scale = config.head_dim**-0.5
        self.eps = config.rms_norm_eps
        self.ratio = config.compress_ratio(layer)
        self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, config.num_heads * config.head_dim, bias=False)
        self.kv_proj = nn.Linear(config.hidden_size, config.head_dim, bias=False)
        self.kv_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        per_group = config.num_heads * config.head_dim // config.o_groups
        self.o_groups = config.o_groups
        self.o_a_proj = GroupedLinear(per_group, config.o_groups * config.o_lora_rank, config.o_groups)
        self.o_b_proj = nn.Linear(config.o_groups * config.o_lora_rank, config.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(config.num_heads, dtype=torch.float32))
        if self.layer_type == CSA:
            self.compressor = WindowPooler(config, config.head_dim, self.ratio, True, rotaries["compress"])
            self.compressor.indexer = Indexer(config, rotaries["compress"])
        elif self.layer_type == HCA:
            self.compressor = WindowPooler(config, config.head_dim, self.ratio, False, rotaries["compress"])
        else:
            self.compressor = None

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        cos, sin = batch.rope[self.rope_flavour]
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_residual).unflatten(-1, (self.n_heads, self.head_dim))
        q = apply_rope_after_unweighted_norm(q, self.eps, cos, sin)  # one fused pass on a GPU
        kv = apply_rope_after_norm(self.kv_proj(x), self.kv_norm, cos, sin)
        packed = {}
        if self.compressor is not None:
            packed["kv"], packed["gate"] = self.compressor.project(x)
        if self.layer_type == CSA:
            indexer = self.compressor.indexer
            packed["ikv"], packed["igate"] = indexer.project(x)
            packed["iq"] = indexer.queries(q_residual, cos, sin)
            packed["iw"] = indexer.scorer.head_weights(x)
        singles = 0 if batch.decode is None else batch.decode.num_rows  # leading one-token sequences
        if singles == q.shape[0]:
            out = self._attend_decode_batch(q, kv, packed, batch.decode)
        elif len(batch.states) == 1:
            out = self._attend_sequence(q, kv, packed, batch.states[0], batch.captures[0] if batch.captures else ())
        else:
            out = torch.empty_like(q)
            if singles:
                head = {name: t[:singles] for name, t in packed.items()}
                out[:singles] = self._attend_decode_batch(q[:singles], kv[:singles], head, batch.decode)
            for i in range(singles, len(batch.states)):
                (start, end), state = batch.spans[i], batch.states[i]
                span = {name: t[start:end] for name, t in packed.items()}
                captures = batch.captures[i] if batch.captures else ()
                out[start:end] = self._attend_sequence(q[start:end], kv[start:end], span, state, captures)
        out = apply_rope(out, cos, -sin)
        return self.o_b_proj(self.o_a_proj(out.reshape(out.shape[0], self.o_groups, -1)))

    def _attend_decode_batch(self, q, kv, packed: dict, view) -> torch.Tensor:
        """Token i is the one new token of sequence i: every sequence's state is read and advanced
        by batched operations (`engine.kv.decode_view.DecodeView`), then one masked softmax runs
        over each sequence's [window | entries]. The same keys and masks as `_one_keys`, padded."""
        keys, mask = view.window(self.layer, kv)
        if self.compressor is not None:
            entries = self._advance_batch(view, False, self.compressor, packed["kv"], packed["gate"])
            index_keys = None
            if self.layer_type == CSA:
                indexer = self.compressor.indexer
                index_keys = self._advance_batch(view, True, indexer, packed["ikv"], packed["igate"])
            if entries is not None and takes_kernel("sparse_attention", q):
                view.capture(self.layer)
                return self._sparse_decode_batch(q, keys, mask, entries, index_keys, packed, view)
            if entries is not None:
                entries, visible = entries
                if index_keys is not None:
                    scored = view.max_visible(self.ratio) > indexer.top_k
                    visible = indexer.select_batched(packed["iq"], packed["iw"], index_keys[0], visible, scored)
                keys, mask = torch.cat([keys, entries], dim=1), torch.cat([mask, visible], dim=1)
        view.capture(self.layer)
        return self._softmax_attend_batch(q, keys, mask)

    def _advance_batch(self, view, indexer: bool, pooler: WindowPooler, kv, gate):
        """Append the new tokens to the tails, pool the windows they complete into entries; return
        (entries [B, E, d], visible [B, E]) as in `DecodeView.entries`."""
        view.append_tail(self.layer, indexer, kv, gate)
        if view.completes(self.ratio):
            (window_kv, window_gate), (previous_kv, previous_gate, has_previous), starts = \
                view.window_tokens(self.layer, indexer)
            new = pooler.pool_windows(window_kv, window_gate, previous_kv, previous_gate, has_previous, starts)
            view.write_entries(self.layer, indexer, new)
        return view.entries(self.layer, indexer)

    def _softmax_attend_batch(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`_softmax_attend` per sequence: q [B, H, D], keys [B, K, D], mask [B, K]."""
        if (masked_attention := kernel("masked_attention", q)) is not None:
            return masked_attention(q, keys, mask, self.sinks, self.scale)
        logits = (torch.einsum("bhd,bkd->bhk", q, keys) * self.scale).float()
        probs = sink_softmax(logits, mask, self.sinks)
        return torch.einsum("bhk,bkd->bhd", probs.to(keys.dtype), keys)

    def _attend_sequence(self, q, kv, span: dict, state: SequenceKV, captures=()) -> torch.Tensor:
        """One sequence's new tokens (positions state.num_tokens...); updates the state.

        The tokens run in pieces cut at the capture positions (attention is causal, so pieces in
        order give the same result as one), and the state captures itself at each cut.
        """
        first_pos = state.num_tokens
        if not captures:
            return self._attend_piece(q, kv, span, state, first_pos)
        out, lo = torch.empty_like(q), 0
        for cut in (*(c - first_pos for c in captures), None):
            stop = q.shape[0] if cut is None else cut
            if stop > lo:
                rows = slice(lo, stop)
                piece = {name: t[rows] for name, t in span.items()}
                out[rows] = self._attend_piece(q[rows], kv[rows], piece, state, first_pos + lo)
                lo = stop
            if cut is not None:
                state.capture(self.layer, first_pos + cut)
        return out

    def _attend_piece(self, q, kv, span: dict, state: SequenceKV, first_pos: int) -> torch.Tensor:
        """Tokens at positions first_pos... against the state; appends their KV and entries to it."""
        if q.shape[0] == 1:
            return self._softmax_attend(q, *self._one_keys(kv, span, state, first_pos))
        prior = state.window(self.layer, first_pos)
        window_start = first_pos - prior.shape[0]
        keys = torch.cat([prior, kv])
        state.append_window(self.layer, kv, first_pos)
        entries, index_keys = self._advance_compressed(span, state, first_pos, first_pos + q.shape[0])
        if takes_kernel("sparse_attention", q):
            return self._sparse_piece(q, keys, window_start, entries, index_keys, span, first_pos)
        out = torch.empty_like(q)
        for lo in range(0, q.shape[0], QUERY_BLOCK):
            rows = slice(lo, min(lo + QUERY_BLOCK, q.shape[0]))
            first, last = first_pos + rows.start, first_pos + rows.stop - 1  # the block's query positions
            positions = torch.arange(first, last + 1, device=q.device)
            key_lo = max(first - self.window + 1, window_start)
            block_keys = keys[key_lo - window_start : last + 1 - window_start]
            mask = window_mask(positions, key_lo, last, self.window)
            if entries is not None:
                n_visible = (last + 1) // self.ratio
                block_keys = torch.cat([block_keys, entries[:n_visible]])
                mask = torch.cat([mask, self._entry_mask(positions, n_visible, span, index_keys, rows)], dim=1)
            out[rows] = self._softmax_attend(q[rows], block_keys, mask)
        return out

    def _sparse_piece(self, q, keys, window_start: int, entries, index_keys, span: dict, first_pos: int):
        """`_attend_piece`'s attention by the sparse kernel: each query's rows of the window keys and
        its entries (all visible ones, or the indexer's top-k as indices), no mask, no query blocks."""
        sparse_attention = load_kernel("sparse_attention")
        positions = torch.arange(first_pos, first_pos + q.shape[0], device=q.device)
        window_hi = positions + 1 - window_start  # rows of keys (which start at window_start)
        window_lo = (window_hi - self.window).clamp(min=0)
        if entries is None:
            return sparse_attention(q, keys, window_lo, window_hi, None, self.sinks, self.scale)
        counts = (positions + 1) // self.ratio
        if self.layer_type == CSA and entries.shape[0] > self.compressor.indexer.top_k:
            indexer = self.compressor.indexer
            chunk = max(QUERY_BLOCK, SCORE_ELEMENTS // entries.shape[0])  # bounds the [n, E] scores
            chosen = torch.cat([
                indexer.top_k_indices(span["iq"][lo : lo + chunk], span["iw"][lo : lo + chunk], index_keys,
                                      counts[lo : lo + chunk])
                for lo in range(0, q.shape[0], chunk)
            ])
            return sparse_attention(q, keys, window_lo, window_hi, entries, self.sinks, self.scale, entry_idx=chosen)
        return sparse_attention(q, keys, window_lo, window_hi, entries, self.sinks, self.scale, entry_count=counts)

    def _sparse_decode_batch(self, q, window, window_mask, entries, index_keys, packed: dict, view):
        """`_attend_decode_batch`'s attention by the sparse kernel, without concatenating the window and
        the entries: (entries [B, E, D], visible [B, E]) as `view.entries` gives them; visible is a prefix."""
        sparse_attention = load_kernel("sparse_attention")
        entries, visible = entries
        counts = visible.sum(dim=1)
        lo = torch.zeros_like(counts)
        hi = torch.full_like(counts, window.shape[1])
        indexer = self.compressor.indexer if self.layer_type == CSA else None
        if indexer is not None and view.max_visible(self.ratio) > indexer.top_k:  # host-side: no sync
            chosen = indexer.top_k_indices(packed["iq"], packed["iw"], index_keys[0], counts)
            return sparse_attention(q, window, lo, hi, entries, self.sinks, self.scale, entry_idx=chosen,
                                    window_mask=window_mask)
        return sparse_attention(q, window, lo, hi, entries, self.sinks, self.scale, entry_count=counts,
                                window_mask=window_mask)

    def _advance_compressed(self, span: dict, state: SequenceKV, start: int, end: int):
        """Pool the new tokens [start, end) into compressed entries (and CSA indexer keys); return all
        entries and indexer keys complete by `end` (None for a sliding-only layer)."""
        if self.compressor is None:
            return None, None
        done, total = start // self.ratio, end // self.ratio
        tail = state.tail(self.layer, start)
        new = self.compressor.pool(span["kv"], span["gate"], tail, done)
        state.set_tail(self.layer, end, tail)
        state.write_entries(self.layer, done, new)
        entries, index_keys = state.entries(self.layer, total), None
        if self.layer_type == CSA:
            indexer = self.compressor.indexer
            tail = state.tail(self.layer, start, indexer=True)
            new = indexer.pool(span["ikv"], span["igate"], tail, done)
            state.set_tail(self.layer, end, tail, indexer=True)
            state.write_index_keys(self.layer, done, new)
            index_keys = state.index_keys(self.layer, total)
        return entries, index_keys

    def _one_keys(self, kv, span: dict, state: SequenceKV, position: int):
        """One new token at `position` (decode): advance the state as `_attend_piece` does; return the
        keys it attends and their mask. Every window key and every visible entry is in the mask, so
        the only mask left is the CSA indexer's top-k (None when there is none)."""
        prior = state.window(self.layer, position)
        window_start = position - prior.shape[0]
        prior = prior[max(position - self.window + 1, window_start) - window_start :]  # still in the window
        state.append_window(self.layer, kv, position)
        entries, index_keys = self._advance_compressed(span, state, position, position + 1)
        n_visible = (position + 1) // self.ratio if entries is not None else 0
        block_keys = torch.cat([prior, kv, entries[:n_visible]] if n_visible else [prior, kv])
        mask = None
        if entries is not None:
            if n_visible:
                if self.layer_type == CSA and n_visible > self.compressor.indexer.top_k:
                    positions = torch.tensor([position], device=kv.device)
                    entry_mask = self._entry_mask(positions, n_visible, span, index_keys, slice(0, 1))
                    mask = torch.cat([entry_mask.new_ones(1, block_keys.shape[0] - n_visible), entry_mask], dim=1)
        return block_keys, mask

    def _entry_mask(self, positions, n_visible: int, span: dict, index_keys, rows: slice) -> torch.Tensor:
        """Entry w is visible at position p iff (w + 1) * ratio <= p + 1; CSA keeps the indexer's top-k."""
        if self.layer_type == CSA:
            indexer = self.compressor.indexer
            return indexer.select(span["iq"][rows], span["iw"][rows], index_keys[:n_visible], positions)
        entry = torch.arange(n_visible, device=positions.device)
        return entry[None, :] < ((positions + 1) // self.ratio)[:, None]

    def _softmax_attend(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One softmax over the visible keys plus a per-head sink logit; keys double as values."""
        if (masked_attention := kernel("masked_attention", q)) is not None:
            return masked_attention(q, keys, mask, self.sinks, self.scale)
        logits = (torch.einsum("qhd,kd->qhk", q, keys) * self.scale).float()
        probs = sink_softmax(logits, mask, self.sinks)
        return torch.einsum("qhk,kd->qhd", probs.to(keys.dtype), keys)
