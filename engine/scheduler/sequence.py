"""One request inside the engine: its tokens, progress, KV state and what it produced this step."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING

import torch

from engine.kv.manager import Restored
from engine.kv.paged_state import PagedState
from messages.common import FinishReason, SamplingParams
from messages.prefix import BLOCK_TOKENS, block_hashes

if TYPE_CHECKING:
    from engine.grammar import GrammarState


class SequenceStatus(IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2
    HELD = 3  # prefill-only: first token out, state kept (not scheduled) until snapshot + release


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt, then generated
    num_prompt_tokens: int
    sampling: SamplingParams
    model_id: str
    arrival_time: float = 0.0
    generator: torch.Generator | None = None
    prefill_only: bool = False  # hold after the first sampled token instead of decoding on
    exact_prefix: bool = False  # no bounded-replay prefix hit (EngineRequest.exact_prefix)
    grammar: GrammarState | None = None  # structured output: masks sampling, accepts each sampled token
    images: list = field(default_factory=list)  # the prompt's images (messages.images.ImageInput): their
                                                # digests enter the block hashes
    image_embeds: list = field(default_factory=list)  # per image: its span rows [tokens, hidden], or None
                                                      # where the caller knew the prefix cache covers it
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed: int = 0  # tokens whose KV the state holds
    num_cached_tokens: int = 0  # tokens taken from the prefix cache (or a hand-off) on first admission
    num_registered_blocks: int = 0  # full blocks already offered to the prefix index
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    state: PagedState | None = None
    restored: Restored | None = None  # hand-off state waiting for admission
    finish_reason: FinishReason | None = None
    new_token_ids: list[int] = field(default_factory=list)  # since the last output
    new_logprobs: list[float] = field(default_factory=list)
    new_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    def __post_init__(self):
        self.update_hashes()

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_remaining(self) -> int:
        """Tokens to feed before the next token can be sampled."""
        return len(self.token_ids) - self.num_computed

    def update_hashes(self) -> None:
        self.block_hashes = block_hashes(self.model_id, self.token_ids, previous=self.block_hashes,
                                         images=self.images)

    def missing_image_before(self, start: int) -> int | None:
        """The index of an image ending after position `start` whose embeddings this sequence lacks."""
        return next((i for i, image in enumerate(self.images)
                     if image.end > start and (i >= len(self.image_embeds) or self.image_embeds[i] is None)), None)

    def append(self, token_id: int, logprob: float | None, top: list[tuple[int, float]] | None) -> None:
        self.token_ids.append(token_id)
        self.new_token_ids.append(token_id)
        if logprob is not None:
            self.new_logprobs.append(logprob)
        if top is not None:
            self.new_top_logprobs.append(top)
        if len(self.token_ids) % BLOCK_TOKENS == 0:
            self.update_hashes()
