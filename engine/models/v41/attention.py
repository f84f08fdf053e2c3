"""V4.1 attention ("CSA2"): one shared-KV head over [own sliding window | selected compressed entries].

Every layer keeps its own window of `sliding_window` fp8-rounded KV. A compressed layer also
attends compressed entries of its KV source (`config.kv_source_of`): the source layer pools them
and writes them, with their indexer keys, to the state; later layers only read them. Which
entries a query attends comes from the last index source (the source itself or a "reindex"
layer), which scores the visible entries with its own indexer; "reuse" layers take that choice
as it is. The choice travels from layer to layer in a `Selection` (one per sequence and forward;
never cached). Queries are not RMS-normalised per head (V4 normalised them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from engine.models.common.attention_math import sink_softmax, window_mask
from engine.models.common.linear import GroupedLinear
from engine.models.common.norms import RMSNorm
from engine.models.spec import SequenceKV
from engine.models.v41.cache_rounding import COMPRESSED_KV, SWA_KV, round_cache
from engine.models.v41.compressor import LatentCompressor
from engine.models.v41.config import REINDEX, SOURCE, V41Config
from engine.models.v41.indexer import Indexer, candidate_blocks, top_k_mask
from engine.models.v41.rope import V41Rotary, apply_rope

QUERY_BLOCK = 256  # queries per attention block: bounds the score tensors of long prefills


@dataclass(slots=True)
class Selection:
    """The compressed entries each token of one sequence's chunk attends, [length, entries] bool,
    as chosen by the latest index source; `candidates` are the candidate source's blocks."""

    first: int  # absolute position of the chunk's first token
    length: int
    chosen: torch.Tensor | None = None
    candidates: torch.Tensor | None = None


@dataclass(slots=True)
class V41Batch:
    """The packed tokens of one forward: sequence i owns rows spans[i] and advances states[i]."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] absolute positions
    spans: list[tuple[int, int]]
    states: list[SequenceKV]
    angles: dict[str, torch.Tensor]  # "main" / "compress" -> fp32 [T, rope_dim // 2]
    selections: list[Selection]
    image_mask: torch.Tensor | None = None  # [T] bool: image tokens (routing, Engram)
    captures: list[tuple[int, ...]] = field(default_factory=list)
    engram_rows: torch.Tensor | None = None  # [T, Engram layers, rows per token] table rows
    engram_dead: torch.Tensor | None = None  # [T] bool: tokens Engram neither hashes over nor updates


class Attention(nn.Module):
    def __init__(self, config: V41Config, layer: int, rotaries: dict[str, V41Rotary]):
        super().__init__()
        self.layer, self.role = layer, config.role(layer)
        self.ratio, self.source = config.compress_ratios[layer], config.kv_source_of(layer)
        self.flavour = "compress" if self.ratio else "main"
        self.rotary = rotaries[self.flavour]
        self.n_heads, self.head_dim, self.window = config.num_heads, config.head_dim, config.sliding_window
        self.scale = config.head_dim**-0.5
        self.candidate_source = layer == config.candidate_source_layer_id
        self.uses_candidates = config.uses_candidates(layer)
        self.top_blocks, self.block = config.candidate_topk_blocks, config.candidate_block_size
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.wq_a = nn.Linear(hidden, config.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(config.q_lora_rank, eps)
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(hidden, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, eps)
        self.o_groups = config.o_groups
        per_group = self.n_heads * self.head_dim // config.o_groups
        self.wo_a = GroupedLinear(per_group, config.o_groups * config.o_lora_rank, config.o_groups)
        self.wo_b = nn.Linear(config.o_groups * config.o_lora_rank, hidden, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        self.compressor = LatentCompressor(config, self.ratio) if self.role == SOURCE else None
        self.indexer = Indexer(config, owns_keys=self.role == SOURCE) if self.role in (SOURCE, REINDEX) else None

    def forward(self, x: torch.Tensor, batch: V41Batch) -> torch.Tensor:
        angles = batch.angles[self.flavour]
        query_latent = self.q_norm(self.wq_a(x))
        q = apply_rope(self.wq_b(query_latent).unflatten(-1, (self.n_heads, self.head_dim)), angles)
        kv = round_cache(apply_rope(self.kv_norm(self.wkv(x)), angles), SWA_KV)
        packed = {} if self.compressor is None else self.compressor.project(x)
        if self.indexer is not None:
            packed["iq"] = self.indexer.queries(query_latent, angles)
            packed["iw"] = self.indexer.head_weights(x)
        out = torch.empty_like(q)
        for i, ((start, end), state) in enumerate(zip(batch.spans, batch.states)):
            span = {name: t[start:end] for name, t in packed.items()}
            captures = batch.captures[i] if batch.captures else ()
            selection = batch.selections[i]
            out[start:end] = self._attend_sequence(q[start:end], kv[start:end], span, state, selection, captures)
        out = apply_rope(out, angles, inverse=True)
        return self.wo_b(self.wo_a(out.reshape(out.shape[0], self.o_groups, -1)))

    def _attend_sequence(self, q, kv, span: dict, state: SequenceKV, selection: Selection, captures) -> torch.Tensor:
        """One sequence's new tokens, in pieces cut at the capture positions (attention is causal,
        so pieces in order give what one piece gives); the state captures itself at each cut. They
        start at the selection's first position: the state's length, or later in the rows a
        trimmed replay keeps (engine.models.v41.sub_batch)."""
        first = selection.first
        out, lo = torch.empty_like(q), 0
        for cut in (*(c - first for c in captures), None):
            stop = q.shape[0] if cut is None else cut
            if stop > lo:
                piece = {name: t[lo:stop] for name, t in span.items()}
                out[lo:stop] = self._attend_piece(q[lo:stop], kv[lo:stop], piece, state, selection, first + lo)
                lo = stop
            if cut is not None:
                state.capture(self.layer, first + cut)
        return out

    def _attend_piece(self, q, kv, span: dict, state: SequenceKV, selection: Selection, first: int) -> torch.Tensor:
        """Tokens at positions first... against the state; appends their KV (and, at a KV source,
        the entries and index keys they complete) to it."""
        end = first + q.shape[0]
        prior = state.window(self.layer, first)
        window_start = first - prior.shape[0]
        keys = torch.cat([prior, kv])
        state.append_window(self.layer, kv, first)
        entries = index_keys = None
        if self.ratio:
            if self.compressor is not None:
                self._publish(span, state, first, end, q.dtype)
            entries = state.entries(self.source, end // self.ratio)
            if self.indexer is not None:
                index_keys = state.index_keys(self.source, end // self.ratio)
                if first == selection.first:
                    self._start_selection(selection)
        out = torch.empty_like(q)
        for lo in range(0, q.shape[0], QUERY_BLOCK):
            rows = slice(lo, min(lo + QUERY_BLOCK, q.shape[0]))
            low, last = first + rows.start, first + rows.stop - 1  # the block's query positions
            positions = torch.arange(low, last + 1, device=q.device)
            key_lo = max(low - self.window + 1, window_start)
            block_keys = keys[key_lo - window_start : last + 1 - window_start]
            mask = window_mask(positions, key_lo, last, self.window)
            if entries is not None:
                n_visible = (last + 1) // self.ratio
                chosen_rows = slice(low - selection.first, last + 1 - selection.first)
                if self.indexer is not None:
                    self._select(span, rows, positions, index_keys[:n_visible], selection, chosen_rows)
                block_keys = torch.cat([block_keys, entries[:n_visible]])
                mask = torch.cat([mask, selection.chosen[chosen_rows, :n_visible]], dim=1)
            out[rows] = self._softmax_attend(q[rows], block_keys, mask)
        return out

    def _publish(self, span: dict, state: SequenceKV, first: int, end: int, dtype: torch.dtype) -> None:
        """KV source: pool the groups the new tokens complete; write their compressed KV (nvfp4-rounded)
        and index keys (mxfp4-rounded), both rotated at the group's first position."""
        done, total = first // self.ratio, end // self.ratio
        tail = state.tail(self.layer, first) if self.ratio > 1 else None
        latent = self.compressor.pool(span, tail, dtype)
        if tail is not None:
            state.set_tail(self.layer, end, tail)
        angles = self.rotary.angles(torch.arange(done, total, device=latent.device) * self.ratio)
        state.write_entries(self.layer, done, round_cache(apply_rope(latent, angles), COMPRESSED_KV))
        state.write_index_keys(self.layer, done, self.indexer.keys(latent, angles))

    def _start_selection(self, selection: Selection) -> None:
        """An index source replaces the chunk's choice (and the candidate source its candidates)."""
        width = (selection.first + selection.length) // self.ratio
        device = self.attn_sink.device
        selection.chosen = torch.zeros(selection.length, width, dtype=torch.bool, device=device)
        if self.candidate_source:
            selection.candidates = torch.zeros_like(selection.chosen)
        elif self.uses_candidates and (selection.candidates is None or selection.candidates.shape[1] != width):
            raise ValueError(f"layer {self.layer} selects within candidates of another KV source")

    def _select(self, span: dict, rows: slice, positions, index_keys, selection: Selection, chosen_rows: slice) -> None:
        """Score the visible entries for the query rows; keep the top-k (within the candidate blocks
        after the candidate source) in `selection`."""
        n_visible = index_keys.shape[0]
        if n_visible == 0:
            return
        visible_counts = torch.div(positions + 1, self.ratio, rounding_mode="floor")
        visible = torch.arange(n_visible, device=positions.device)[None, :] < visible_counts[:, None]
        scores = self.indexer.scores(span["iq"][rows], span["iw"][rows], index_keys)
        scores = scores.masked_fill(~visible, float("-inf"))
        if self.candidate_source:
            candidates = candidate_blocks(scores, visible_counts, self.top_blocks, self.block) & visible
            selection.candidates[chosen_rows, :n_visible] = candidates
        elif self.uses_candidates:
            scores = scores.masked_fill(~selection.candidates[chosen_rows, :n_visible], float("-inf"))
        selection.chosen[chosen_rows, :n_visible] = top_k_mask(scores, self.indexer.top_k)

    def _softmax_attend(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One fp32 softmax over the allowed keys plus a per-head sink logit; keys double as values."""
        logits = torch.einsum("qhd,kd->qhk", q.float(), keys.float()) * self.scale
        probs = sink_softmax(logits, mask, self.attn_sink)
        return torch.einsum("qhk,kd->qhd", probs, keys.float()).to(q.dtype)
