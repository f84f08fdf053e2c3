"""Engram n-gram hashing: which table rows each position reads.

Position t of a sequence gets one row per (n-gram size n in 2..max_ngram, head h). The n-gram is
the compressed ids of tokens t, t-1, ..., t-n+1. Token t-s contributes id * multiplier[layer, s];
the contributions are XOR-ed together (a running XOR, so the (n+1)-gram extends the n-gram's
value), reduced modulo the head's prime and shifted by the head's offset, which places every
(n, head) pair in its own disjoint bucket range of the layer's table.

Lookback stops at the sequence start, at image tokens and at padding: from the first such token
on (walking back from t), it and every earlier slot contribute the pad token's compressed id.

Primes: for every layer (in `engram_layer_ids` order) and n-gram size, the next `n_heads` primes
above `engram_vocab_size - 1` that no earlier (layer, n, head) took. Multipliers: odd numbers drawn
from numpy's `default_rng(10007 * layer_id)`, bounded so id * multiplier fits int64.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.models.v41.config import V41Config
from engine.models.v41.engram_vocab import compressed_vocab

_DEAD = -1  # image or padding token
_ABSENT = -2  # before the sequence start
_WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # deterministic Miller-Rabin below 3.3e24


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _WITNESSES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in _WITNESSES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def bucket_primes(num_layers: int, vocab_size: int, max_ngram: int, n_heads: int) -> list[tuple[int, ...]]:
    """Per Engram layer, the (max_ngram - 1) * n_heads bucket sizes, n-gram major."""
    taken: set[int] = set()
    layers = []
    for _ in range(num_layers):
        primes = []
        for _ in range(max_ngram - 1):
            candidate = vocab_size - 1
            for _ in range(n_heads):
                candidate += 1
                while candidate in taken or not is_prime(candidate):
                    candidate += 1
                taken.add(candidate)
                primes.append(candidate)
        layers.append(tuple(primes))
    return layers


def engram_row_counts(num_layers: int, vocab_size: int, max_ngram: int, n_heads: int) -> tuple[int, ...]:
    """Table rows each Engram layer needs (the released `engram_num_embeddings` are exactly these)."""
    return tuple(sum(p) for p in bucket_primes(num_layers, vocab_size, max_ngram, n_heads))


def config_row_counts(config: V41Config) -> tuple[int, ...]:
    return engram_row_counts(len(config.engram_layer_ids), config.engram_vocab_size,
                             config.engram_max_ngram_size, config.engram_n_heads)


def hash_multipliers(layer_ids: Sequence[int], max_ngram: int, compressed_vocab_size: int) -> torch.Tensor:
    """[layers, max_ngram] odd int64 multipliers, one per lookback shift."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    rows = [np.random.default_rng(10007 * layer).integers(0, bound, size=(max_ngram,), dtype=np.int64) * 2 + 1
            for layer in layer_ids]
    return torch.from_numpy(np.stack(rows))


class NgramHasher(nn.Module):
    """Hash rows for every Engram layer: `[T, engram layers, rows_per_token]` int64 table row ids.

    `token_map` is `CompressedVocab.token_map` of the model's tokenizer; its count must equal
    `config.engram_compressed_vocab_size`. Buffers follow `.to(device)`; hashing runs where the
    ids are (no host sync).
    """

    def __init__(self, config: V41Config, token_map: torch.Tensor, compressed_size: int | None = None):
        super().__init__()
        if not config.engram_layer_ids or config.engram_max_ngram_size < 2 or config.engram_n_heads < 1:
            raise ValueError("Engram hashing needs Engram layers, n-grams of 2 or more and at least one head")
        size = int(token_map.max()) + 1 if compressed_size is None else compressed_size
        if size != config.engram_compressed_vocab_size:
            raise ValueError(f"the tokenizer compresses to {size} ids, the config expects "
                             f"{config.engram_compressed_vocab_size}: the hash multipliers depend on it")
        if not 0 <= config.engram_pad_token_id < token_map.numel():
            raise ValueError(f"engram_pad_token_id {config.engram_pad_token_id} is outside the tokenizer")
        primes = bucket_primes(len(config.engram_layer_ids), config.engram_vocab_size,
                               config.engram_max_ngram_size, config.engram_n_heads)
        for layer, need, have in zip(config.engram_layer_ids, map(sum, primes), config.engram_num_embeddings):
            if need > have:
                raise ValueError(f"Engram layer {layer} hashes into {need} rows, config has {have}")
        self.layer_ids = tuple(config.engram_layer_ids)
        self.max_ngram = config.engram_max_ngram_size
        self.n_heads = config.engram_n_heads
        self.rows_per_token = (self.max_ngram - 1) * self.n_heads
        self.lookback = self.max_ngram - 1  # == config.engram_context
        self.image_token_id = config.image_token_id
        self.pad_id = int(token_map[config.engram_pad_token_id])
        offsets = [np.cumsum([0, *p[:-1]]).tolist() for p in primes]
        self.register_buffer("token_map", token_map.to(torch.long).clone(), persistent=False)
        self.register_buffer("primes", torch.tensor(primes, dtype=torch.long), persistent=False)
        self.register_buffer("offsets", torch.tensor(offsets, dtype=torch.long), persistent=False)
        self.register_buffer("multipliers", hash_multipliers(self.layer_ids, self.max_ngram, size), persistent=False)

    @classmethod
    def from_tokenizer(cls, config: V41Config, tokenizer_json: str | Path) -> "NgramHasher":
        vocab = compressed_vocab(tokenizer_json)
        return cls(config, vocab.token_map, vocab.size)

    def forward(self, ids: torch.Tensor, context: Sequence[int] | torch.Tensor = (),
                image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """One sequence's chunk: ids [T]; context: the ids just before it (the last `lookback` are
        used; fewer means the sequence starts there); image_mask [T]: True at image or padding
        tokens. Ids equal to image_token_id (in the chunk or the context) always count as images."""
        return self.packed(ids, [(0, ids.numel())], [context], image_mask)

    def packed(self, ids: torch.Tensor, spans: Sequence[tuple[int, int]],
               contexts: Sequence[Sequence[int] | torch.Tensor], image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Several sequences packed in ids [T]; sequence i owns ids[spans[i][0]:spans[i][1]] (spans
        ascend and cover T) and contexts[i] are its earlier ids."""
        if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError("ids must be a 1-D integer tensor")
        if not spans or len(spans) != len(contexts):
            raise ValueError("need at least one span, and one context per span")
        ids = ids.to(self.token_map.device, torch.long)
        if ids.device.type == "cpu" and ids.numel() and (ids.min() < 0 or ids.max() >= self.token_map.numel()):
            raise ValueError("a token id is outside the tokenizer vocabulary")
        dead = ids == self.image_token_id
        if image_mask is not None:
            if image_mask.shape != ids.shape:
                raise ValueError("image_mask must have the shape of ids")
            dead = dead | image_mask.to(ids.device, torch.bool)
        window, index = self._window(spans, contexts, ids.numel())
        extended = torch.empty(window.numel() + ids.numel(), dtype=torch.long, device=ids.device)
        chunk_slots = index.to(ids.device)
        extended[chunk_slots] = torch.where(dead, _DEAD, self.token_map[ids])
        extended[self._window_slots(spans).to(ids.device)] = window
        return self._hash(extended, chunk_slots)

    def _window(self, spans, contexts, total: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Compressed lookback ids [B * lookback] and each token's slot in the extended layout
        (every sequence's lookback window followed by its chunk)."""
        k, rows, index, start = self.lookback, [], [], 0
        for i, ((begin, end), context) in enumerate(zip(spans, contexts)):
            if begin != start or end < begin:
                raise ValueError(f"spans must be ascending and contiguous, got {list(spans)}")
            earlier = [int(t) for t in (context.tolist() if isinstance(context, torch.Tensor) else context)][-k:]
            rows.append([_ABSENT] * (k - len(earlier)) + earlier)
            index.append(torch.arange(begin, end) + k * (i + 1))
            start = end
        if start != total:
            raise ValueError(f"spans cover {start} of {total} tokens")
        raw = torch.tensor(rows, dtype=torch.long).reshape(-1)
        if raw.numel() and raw.max() >= self.token_map.numel():
            raise ValueError("a context id is outside the tokenizer vocabulary")
        raw = raw.to(self.token_map.device)
        window = torch.where(raw >= 0, self.token_map[raw.clamp_min(0)], _ABSENT)
        window = torch.where(raw == self.image_token_id, _DEAD, window)
        return window, torch.cat(index)

    def _window_slots(self, spans) -> torch.Tensor:
        k = self.lookback
        return torch.cat([torch.arange(k) + begin + k * i for i, (begin, _) in enumerate(spans)])

    def _hash(self, extended: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        rolling = torch.zeros(slots.numel(), len(self.layer_ids), dtype=torch.long, device=slots.device)
        blocked = torch.zeros(slots.numel(), dtype=torch.bool, device=slots.device)
        out = []
        for shift in range(self.max_ngram):
            source = extended[slots - shift]
            blocked = blocked | (source < 0)
            value = torch.where(blocked, self.pad_id, source)
            rolling = rolling ^ (value[:, None] * self.multipliers[:, shift])
            if shift:
                heads = slice((shift - 1) * self.n_heads, shift * self.n_heads)
                out.append(rolling[..., None] % self.primes[:, heads] + self.offsets[:, heads])
        return torch.cat(out, dim=-1)
