"""The model contract: what the engine (KV manager, runner, scheduler, EngineCore) may ask of a model
and its config. Both families satisfy it explicitly: V4 (`engine.models.v4`) and V4.1
(`engine.models.v41`) each answer every question below, including "no" (V4 has no Engram context,
no vision and no trimmed replay; V4.1 has no CUDA-graph decode yet). Nothing outside a family's
package asks a model or config anything else, and nothing probes for an attribute.

`check_model` / `check_config` verify the contract at runtime (EngineCore calls the first on a model
it is handed); the protocols are `runtime_checkable` for that.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from engine.models.common.tail import PoolerTail


@runtime_checkable
class CacheSpec(Protocol):
    """What the KV cache holds per layer (engine/kv): page layout, window slots, tail rings, replay."""

    num_layers: int
    head_dim: int  # width of the window KV and of a compressed entry
    index_head_dim: int  # width of an indexer key
    sliding_window: int  # tokens of the window every layer keeps

    def compress_ratio(self, layer: int) -> int:
        """Tokens per compressed entry the layer OWNS in the cache (0: it owns none)."""

    def owns_index_keys(self, layer: int) -> bool:
        """The layer keeps indexer keys, one per compressed entry, in the pages."""

    def overlapping_tail(self, layer: int) -> bool:
        """The layer's tail keeps the overlap half of the last full window (V4's CSA)."""

    def has_index_tail(self, layer: int) -> bool:
        """The layer's indexer pools keys of its own and keeps a tail for them."""

    @property
    def supports_bounded_replay(self) -> bool:
        """Pages at a block boundary are the whole compressed state, so a prefix hit without a
        saved window may replay its last block to rebuild the windows (engine/kv/manager.py)."""

    @property
    def last_kv_source(self) -> int:
        """The last layer whose compressed KV later layers read; a trimmed replay runs the layers
        above it on its last window rows only. -1: no such layer, no trimmed replay."""

    @property
    def engram_context(self) -> int:
        """Earlier token ids a sequence must keep to continue (V4.1's Engram n-grams); 0: none."""


@runtime_checkable
class ModelConfigSpec(CacheSpec, Protocol):
    """A model config as the engine reads it: the cache questions plus tokens and limits."""

    vocab_size: int
    hidden_size: int
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_id: int | None  # the primary end-of-sequence id, for APIs that take one (a grammar's EOS)
    eos_token_ids: tuple[int, ...]  # every id that ends generation, eos_token_id first
    dtype: str  # the checkpoint's dtype name, the default of the engine's

    @property
    def image_token_id(self) -> int | None:
        """The placeholder id of an image span's tokens; None: the model takes no images."""

    @property
    def quant_block(self) -> int:
        """Block edge of the release's FP8 scales and MXFP4 groups (engine/quant/pack_model.py)."""

    @property
    def unquantized_linears(self) -> tuple[str, ...]:
        """Suffixes of the module names whose linears the release keeps unquantized."""


@runtime_checkable
class SequenceKV(Protocol):
    """What attention needs from one sequence's state; positions are absolute token positions."""

    num_tokens: int
    trim_from: int  # a trimmed replay's first row that runs the layers above the last KV source (0: none)
    recent_ids: list[int]  # the last `engram_context` token ids
    # how a decode step of many such states runs batched (engine.kv.decode_view), or None: one by one
    decode_view_type: ClassVar[type | None]

    def window(self, layer: int, position: int) -> torch.Tensor:
        """KV of the last (at most sliding_window) tokens before `position`, oldest first."""

    def append_window(self, layer: int, kv: torch.Tensor, position: int) -> None:
        """Record the KV of tokens [position, position + len(kv))."""

    def entries(self, layer: int, count: int) -> torch.Tensor:
        """The first `count` compressed entries [count, head_dim]."""

    def write_entries(self, layer: int, first: int, new: torch.Tensor) -> None: ...

    def index_keys(self, layer: int, count: int) -> torch.Tensor: ...

    def write_index_keys(self, layer: int, first: int, new: torch.Tensor) -> None: ...

    def tail(self, layer: int, position: int, indexer: bool = False) -> PoolerTail | None:
        """The compressor (or CSA indexer) tail as it stands at `position`; callers may change it in
        place and hand it back with `set_tail`."""

    def set_tail(self, layer: int, position: int, tail: PoolerTail, indexer: bool = False) -> None:
        """Keep `tail` as the layer's tail at `position`."""

    def capture(self, layer: int, position: int) -> None:
        """Keep a copy of the layer's window and tails as they stand at `position` (a block boundary)."""


@dataclass(frozen=True, slots=True)
class ModelCapabilities:
    """What a model can do beyond the plain forward; the engine turns features on from these."""

    decode_graphs: bool  # replays decode steps from CUDA graphs (`model.decode_graphs` is not None)
    bounded_replay: bool  # the config's supports_bounded_replay
    trimmed_replay: bool  # a replay may skip the layers above the last KV source on early rows
    vision: bool  # takes image embeddings (`embeds`) for spans of `image_token_id`
    draft_heads: int  # MTP heads the model runs for speculative decoding (0: none)


class DecodeGraphControl(Protocol):
    """A model's CUDA-graph decode switch (V4's `DecodeGraphs`)."""

    enabled: bool


class PackableExperts(nn.Module):
    """Routed experts that can hold their weights in the release's formats (pack_model.py finds them
    by this base class). Subclasses implement both methods."""

    def expert_weights(self) -> list[torch.Tensor]:
        """The plain expert weight stacks (empty once packed)."""
        raise NotImplementedError

    def pack_(self, fmt: str, block: int) -> None:
        """Replace the plain stacks by packed ones in format `fmt` with scale blocks of `block`."""
        raise NotImplementedError


@runtime_checkable
class ModelSpec(Protocol):
    """A loaded causal LM as the engine drives it (an `nn.Module`)."""

    config: ModelConfigSpec
    decode_graphs: DecodeGraphControl | None  # None: the model decodes eagerly

    @property
    def capabilities(self) -> ModelCapabilities: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype:
        """Activation (and state) dtype."""

    def new_state(self) -> SequenceKV:
        """An empty contiguous state (the paged state's oracle)."""

    def __call__(self, chunks: Sequence[torch.Tensor], states: Sequence[SequenceKV], all_logits: bool = False,
                 captures: Sequence[Sequence[int]] | None = None, **inputs) -> torch.Tensor:
        """Run chunks[i] (1-D token ids) on states[i], advancing each state in place; logits of each
        chunk's last token [B, vocab] (every token with all_logits). captures[i]: block boundaries
        where state i saves its windows and tails. `embeds` (vision models only): image rows."""

    def modules(self) -> Iterator[nn.Module]: ...

    def named_modules(self) -> Iterator[tuple[str, nn.Module]]: ...


def check_config(config: object) -> ModelConfigSpec:
    """`config` if it answers every question of ModelConfigSpec, else TypeError naming what is missing."""
    return _check(config, ModelConfigSpec, "model config")


def check_model(model: object) -> ModelSpec:
    """`model` if it (and its config) satisfy the contract, else TypeError naming what is missing."""
    _check(model, ModelSpec, "model")
    check_config(model.config)
    return model


def _check(value, protocol, what: str):
    if isinstance(value, protocol):
        return value
    missing = sorted(name for name in _members(protocol) if name not in dir(value))
    raise TypeError(f"{type(value).__name__} is not a {what} the engine can serve: it lacks {missing}")


def _members(protocol) -> set[str]:
    names = set()
    for cls in protocol.__mro__:
        if cls is object or cls is Protocol or cls.__name__ == "Generic":
            continue
        names |= {n for n in vars(cls) if not n.startswith("_")} | set(vars(cls).get("__annotations__", {}))
    return names
