"""DeepSeek V4.1 causal LM (text) over explicit per-sequence state.

`DeepseekV41.forward(chunks, states)` is the model contract's (`engine.models.spec.ModelSpec`): a chunk
of new tokens per sequence (a whole prompt, a prefill piece, or one decode token), each state
advanced in place. Module names are the released checkpoint's (`embed`, `layers.N.attn.wq_a`,
`layers.N.hc_attn_fn`, `head`, ...), so a dequantized checkpoint loads with `load_state_dict`.

Per block: [Engram] -> attention site -> FFN site, with single-pass mHC (`engine.models.v41.hyper`).

Images: `embeds` replaces the embedding rows of a prompt's image span with the vision encoder's
(`engine.models.v41.vision`) before the hc expansion; in a step that carries any, every token whose id is
`image_token_id` routes with `bias_vl` and has Engram masked (docs/design/v41-reference.md).

A trimmed replay (a state with `trim_from`, set by engine/kv/manager.py) runs the layers above the
last KV source only on its rows at or after `trim_from` (`engine.models.v41.sub_batch`); the others get
zero logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engine.models.common.captures import checked_captures
from engine.models.common.embedding import TokenEmbedding
from engine.models.common.norms import RMSNorm
from engine.models.common.state import SequenceState
from engine.models.spec import ModelCapabilities, SequenceKV
from engine.models.v41 import hyper
from engine.models.v41.attention import Attention, Selection, V41Batch
from engine.models.v41.config import V41Config
from engine.models.v41.engram import Engram
from engine.models.v41.engram_hash import NgramHasher
from engine.models.v41.moe import MoE
from engine.models.v41.rope import V41Rotary
from engine.models.v41.sub_batch import SubBatch, select_rows, trimmed_rows

# Parameters the release keeps in fp32 whatever the model dtype (suffix match on the name);
# norms stay fp32 as in our V4 (a bf16 checkpoint value converts exactly).
FP32_SUFFIXES = ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
                 "attn_sink", "compressor.wkv.weight", "compressor.wgate.weight", "gate.bias", "gate.bias_vl",
                 "norm.weight", "head.weight")


def keeps_fp32(name: str) -> bool:
    return name.endswith(FP32_SUFFIXES)


class Block(nn.Module):
    def __init__(self, config: V41Config, layer: int, rotaries: dict[str, V41Rotary]):
        super().__init__()
        self.config = config
        self.attn = Attention(config, layer, rotaries)
        self.ffn = MoE(config)
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        hyper.register_site(self, "attn", config)
        hyper.register_site(self, "ffn", config)
        self.engram = Engram(config, layer) if layer in config.engram_layer_ids else None

    def forward(self, streams: torch.Tensor, pre: torch.Tensor, batch: V41Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """streams [T, hc_mult, hidden], pre [T, hc_mult] (the previous site's) -> both, updated."""
        if self.engram is not None:
            rows = batch.engram_rows[:, self.engram.hash_index]
            streams = self.engram(streams, rows, ~batch.engram_dead)
        attn_mix, collapsed = hyper.mix_and_collapse(streams, pre, self.hc_attn_fn, self.hc_attn_base,
                                                     self.hc_attn_scale, self.config)
        attended = self.attn(self.attn_norm(collapsed), batch)
        streams = hyper.expand(attended, streams, attn_mix)
        ffn_mix, collapsed = hyper.mix_and_collapse(streams, attn_mix.pre, self.hc_ffn_fn, self.hc_ffn_base,
                                                    self.hc_ffn_scale, self.config)
        out = self.ffn(self.ffn_norm(collapsed), batch.image_mask)
        return hyper.expand(out, streams, ffn_mix), ffn_mix.pre


class DeepseekV41(nn.Module):
    """Satisfies `engine.models.spec.ModelSpec`. `engram_hash`: the n-gram hasher of the model's tokenizer; a model with Engram layers needs
    it to run (it is built from the tokenizer, not the checkpoint)."""

    def __init__(self, config: V41Config, engram_hash: NgramHasher | None = None):
        super().__init__()
        self.config = config
        self.engram_hash = engram_hash
        self.rotaries = {
            "main": V41Rotary(config.rope_theta, config.rope_dim),
            "compress": V41Rotary(config.compress_rope_theta, config.rope_dim, config.rope_scaling),
        }
        self.embed = TokenEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i, self.rotaries) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=torch.float32)
        self.decode_graphs = None  # V4.1 decodes eagerly for now

    @property
    def capabilities(self) -> ModelCapabilities:
        config = self.config
        return ModelCapabilities(decode_graphs=False, bounded_replay=config.supports_bounded_replay,
                                 trimmed_replay=config.last_kv_source >= 0, vision=config.image_token_id is not None,
                                 draft_heads=0)   # the release's MTP layer is not run (num_nextn_predict_layers)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Activation (and state) dtype."""
        return self.embed.weight.dtype

    def cast(self, dtype: torch.dtype) -> "DeepseekV41":
        """Floating parameters to `dtype`, except those the release keeps in fp32."""
        for name, tensor in [*self.named_parameters(), *self.named_buffers()]:
            if tensor.is_floating_point() and not keeps_fp32(name):
                tensor.data = tensor.data.to(dtype)
        return self

    def new_state(self) -> SequenceState:
        return SequenceState.empty(self.config, device=self.device, dtype=self.dtype)

    @torch.no_grad()
    def forward(
        self,
        chunks: Sequence[torch.Tensor],
        states: Sequence[SequenceKV],
        all_logits: bool = False,
        captures: Sequence[Sequence[int]] | None = None,
        image_masks: Sequence[torch.Tensor] | None = None,
        embeds: Sequence[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
    ) -> torch.Tensor:
        """Run new tokens of each sequence; advance each state in place.

        chunks[i]: 1-D token ids appended to sequence i (non-empty). Returns fp32 logits of the last
        token of every chunk [B, vocab], or of every token packed in chunk order [sum(len), vocab].
        captures[i]: ascending absolute positions in (num_tokens, num_tokens + len] where state i
        captures its windows and tails. image_masks[i]: bool per token of chunk i, True for image
        tokens (routed with `bias_vl`). embeds[i]: None, or (offsets LongTensor [k] within chunk i,
        rows [k, hidden]) that replace those tokens' embeddings (an image span's rows); when any chunk
        has them, tokens with id `image_token_id` are image tokens even without image_masks (a
        text-only step pays nothing for it). Rows a trimmed replay leaves out of the upper layers get
        zero logits (a chunk whose last row is one of them, a zero row); such a chunk captures nothing.
        """
        if len(chunks) != len(states) or not chunks:
            raise ValueError("need one state per chunk and at least one chunk")
        rows = self._embed_rows(chunks, embeds)
        batch = self._pack(chunks, states, image_masks, by_id=rows is not None)
        if captures is not None:
            batch.captures = checked_captures(captures, chunks, states)
        skips = trimmed_rows(batch) if self.config.last_kv_source >= 0 else None
        if skips is not None and any(skip and batch.captures and batch.captures[i] for i, skip in enumerate(skips)):
            raise ValueError("a chunk with trimmed replay rows cannot capture a boundary (its upper windows are cut)")
        spans, kept = batch.spans, None
        if rows is None:
            embedded = self.embed(batch.input_ids)
        else:  # replaced rows look up id 0: an image id need not be inside the vocabulary (tiny test models)
            embedded = self.embed(batch.input_ids.index_fill(0, rows[0], 0))
            embedded[rows[0]] = rows[1].to(embedded.dtype)
        streams = embedded.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        pre = hyper.first_pre(streams.shape[0], self.config, streams.device)
        for layer, block in enumerate(self.layers):
            # above the last KV source nothing cached reads the trimmed rows: drop them there
            if skips is not None and layer == self.config.last_kv_source + 1:
                kept = select_rows(batch, skips)
                if not kept.members:
                    break
                batch, streams, pre = kept.batch, streams[kept.rows], pre[kept.rows]
            streams, pre = block(streams, pre, batch)
        context = self.config.engram_context
        for state, chunk in zip(states, chunks):
            state.num_tokens += chunk.numel()
            if context:
                state.recent_ids = (list(state.recent_ids) + chunk.tolist())[-context:]
        if kept is not None:
            return self._trimmed_logits(streams, pre, kept, spans, all_logits)
        hidden = self.norm(hyper.collapse(streams, pre))
        if not all_logits:
            hidden = hidden[torch.tensor([end - 1 for _, end in batch.spans], device=hidden.device)]
        return self.head(hidden.float())

    def _trimmed_logits(self, streams, pre, kept: SubBatch, spans, all_logits: bool) -> torch.Tensor:
        """Logits of the rows that ran every layer, zeros for the others (as forward returns them)."""
        out = torch.zeros(spans[-1][1] if all_logits else len(spans), self.config.vocab_size,
                          device=self.device, dtype=torch.float32)
        if not kept.members:
            return out
        if all_logits:
            out[kept.rows] = self.head(self.norm(hyper.collapse(streams, pre)).float())
            return out
        last = torch.tensor([end - 1 for _, end in kept.batch.spans], device=streams.device)
        hidden = self.norm(hyper.collapse(streams[last], pre[last]))
        out[torch.tensor(kept.members, device=out.device)] = self.head(hidden.float())
        return out

    def _embed_rows(self, chunks, embeds) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`embeds` as (packed row index [K], rows [K, hidden]) on the model's device, or None."""
        if embeds is None or all(e is None for e in embeds):
            return None
        if len(embeds) != len(chunks):
            raise ValueError("need one embeds entry (or None) per chunk")
        index, rows, start = [], [], 0
        for chunk, entry in zip(chunks, embeds):
            if entry is not None:
                offsets, values = entry
                hidden = self.config.hidden_size
                if offsets.dim() != 1 or offsets.dtype != torch.long or values.shape != (offsets.numel(), hidden):
                    raise ValueError(f"embeds: need offsets LongTensor [k] and rows [k, {hidden}], "
                                     f"got {tuple(offsets.shape)} {offsets.dtype} and {tuple(values.shape)}")
                if offsets.numel() and (int(offsets.min()) < 0 or int(offsets.max()) >= chunk.numel()):
                    raise ValueError(f"embeds: offsets must lie within the chunk's {chunk.numel()} tokens")
                index.append(offsets.to(self.device) + start)
                rows.append(values.to(self.device))
            start += chunk.numel()
        return torch.cat(index), torch.cat(rows)

    def _pack(self, chunks, states, image_masks, by_id: bool = False) -> V41Batch:
        device, spans, positions, selections, start = self.device, [], [], [], 0
        for chunk, state in zip(chunks, states):
            if chunk.dim() != 1 or chunk.numel() == 0:
                raise ValueError("each chunk must be a non-empty 1-D tensor of token ids")
            spans.append((start, start + chunk.numel()))
            positions.append(torch.arange(state.num_tokens, state.num_tokens + chunk.numel()))
            selections.append(Selection(state.num_tokens, chunk.numel()))
            start += chunk.numel()
        input_ids = torch.cat([c.reshape(-1) for c in chunks]).to(device=device, dtype=torch.long)
        positions = torch.cat(positions).to(device)
        image_mask = None
        if image_masks is not None:
            if [m.numel() for m in image_masks] != [c.numel() for c in chunks]:
                raise ValueError("need one image flag per token")
            image_mask = torch.cat([m.reshape(-1) for m in image_masks]).to(device=device, dtype=torch.bool)
        if by_id:
            is_image = input_ids == self.config.image_token_id
            image_mask = is_image if image_mask is None else image_mask | is_image
        angles = {name: rotary.angles(positions) for name, rotary in self.rotaries.items()}
        batch = V41Batch(input_ids, positions, spans, list(states), angles, selections, image_mask)
        if self.config.engram_layer_ids:
            if self.engram_hash is None:
                raise ValueError("a model with Engram layers needs its tokenizer's NgramHasher (engram_hash)")
            batch.engram_dead = input_ids == self.config.image_token_id if image_mask is None else image_mask
            contexts = [list(state.recent_ids) for state in states]
            batch.engram_rows = self.engram_hash.packed(input_ids, spans, contexts, batch.engram_dead)
        return batch
