"""DeepSeek V4 causal LM over explicit per-sequence state.

`DeepseekV4.forward(chunks, states)` processes a chunk of new tokens for each sequence (any size:
a whole prompt, a prefill piece, or one decode token), advancing each `SequenceState` in place.
Parameter names follow the Hugging Face checkpoint layout (`model.layers.N...`, `lm_head.weight`).
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
from engine.models.v4.attention import Attention
from engine.models.v4.batch import ForwardBatch
from engine.models.v4.config import ModelConfig
from engine.models.v4.decode_graph import DecodeGraphs
from engine.models.v4.hyper import HyperConnection, HyperHead, merge_streams
from engine.models.v4.moe import MoE
from engine.models.v4.rope import Rotary


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, rotaries: dict[str, Rotary]):
        super().__init__()
        self.self_attn = Attention(config, layer, rotaries)
        self.mlp = MoE(config, layer)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def forward(self, streams: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """streams [T, hc_mult, hidden] -> same."""
        post, comb, collapsed = self.attn_hc(streams)
        streams = merge_streams(streams, self.self_attn(self.input_layernorm(collapsed), batch), post, comb)
        post, comb, collapsed = self.ffn_hc(streams)
        mlp_out = self.mlp(self.post_attention_layernorm(collapsed), batch.input_ids)
        return merge_streams(streams, mlp_out, post, comb)


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig, rotaries: dict[str, Rotary]):
        super().__init__()
        self.embed_tokens = TokenEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, rotaries) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hc_head = HyperHead(config)
        self.hc_mult = config.hc_mult

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(batch.input_ids)
        streams = hidden.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, batch)
        return self.norm(self.hc_head(streams))


class DeepseekV4(nn.Module):
    """Satisfies `engine.models.spec.ModelSpec`."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.rotaries = {
            "main": Rotary(config.main_rope, config.rope_dim, config.max_position_embeddings),
            "compress": Rotary(config.compress_rope, config.rope_dim, config.max_position_embeddings),
        }
        self.model = Backbone(config, self.rotaries)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.batched_decode = True  # False: decode steps of paged states take the per-sequence path too
        self.decode_graphs = DecodeGraphs(self)  # CUDA only; .enabled = False for the eager batched path

    @property
    def capabilities(self) -> ModelCapabilities:
        return ModelCapabilities(decode_graphs=True, bounded_replay=self.config.supports_bounded_replay,
                                 trimmed_replay=False, vision=False, draft_heads=0)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Activation (and state) dtype."""
        return self.model.embed_tokens.weight.dtype

    def new_state(self) -> SequenceState:
        return SequenceState.empty(self.config, device=self.device, dtype=self.dtype)

    @torch.no_grad()
    def forward(
        self,
        chunks: Sequence[torch.Tensor],
        states: Sequence[SequenceKV],
        all_logits: bool = False,
        captures: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """Run new tokens of each sequence; advance each state in place.

        chunks[i]: 1-D token ids appended to sequence i (non-empty). Returns the logits of the last
        token of every chunk [B, vocab], or of every token packed in chunk order [sum(len), vocab].
        captures[i]: ascending absolute positions in (num_tokens, num_tokens + len] where state i
        captures its window and tails (see `SequenceKV.capture`).
        """
        if len(chunks) != len(states) or not chunks:
            raise ValueError("need one state per chunk and at least one chunk")
        checked = checked_captures(captures, chunks, states) if captures is not None else []
        # the leading sequences that add one token each run batched (decodes come first in a step)
        singles = next((i for i, c in enumerate(chunks) if c.dim() != 1 or c.numel() != 1), len(chunks))
        one_each = singles == len(chunks)
        view_type = states[0].decode_view_type  # the states' batched decode, if any
        batched = (singles > 0 and self.batched_decode and view_type is not None
                   and view_type.supports(list(states[:singles])))
        if batched and one_each and not any(checked):  # captures copy state on the host: never in a graph
            logits = self.decode_graphs.run(torch.cat(list(chunks)).to(self.device, torch.long), list(states), view_type)
            if logits is not None:
                for state in states:
                    state.num_tokens += 1
                return logits
        batch = self._pack(chunks, states)
        batch.captures = checked
        if batched:
            batch.decode = view_type(list(states[:singles]), checked[:singles])
        hidden = self.model(batch)
        if not all_logits and not one_each:
            hidden = hidden[torch.tensor([end - 1 for _, end in batch.spans], device=hidden.device)]
        for state, (start, end) in zip(states, batch.spans):
            state.num_tokens += end - start
        return self.lm_head(hidden)

    def _pack(self, chunks, states) -> ForwardBatch:
        device, spans, positions, start = self.device, [], [], 0
        for chunk, state in zip(chunks, states):
            if chunk.dim() != 1 or chunk.numel() == 0:
                raise ValueError("each chunk must be a non-empty 1-D tensor of token ids")
            spans.append((start, start + chunk.numel()))
            positions.append(torch.arange(state.num_tokens, state.num_tokens + chunk.numel()))
            start += chunk.numel()
        input_ids = torch.cat([c.reshape(-1) for c in chunks]).to(device=device, dtype=torch.long)
        positions = torch.cat(positions).to(device)
        rope = {name: rotary.cos_sin(positions, self.dtype) for name, rotary in self.rotaries.items()}
        return ForwardBatch(input_ids, positions, spans, list(states), rope)

