"""CUDA graphs of the batched decode forward.

A decode step is a few thousand small kernels; launched one by one from Python the GPU idles most
of the step. Here the whole forward (embedding to logits) of a batched decode step is captured
once per shape key and replayed: key = (the states' storage, batch padded to a bucket, page table
padded to a multiple of PAGE_STEP pages). The state's `decode_view_type` builds the view with those fixed shapes (scratch
rows for the padding, masks instead of host-side branches); its metadata and the token ids are
copied into the graph's static inputs before each replay.

Replaying is exact to the eager batched path up to the padding (more masked keys, more rows). A
decode forward is idempotent on the state (it writes the same rows again from the same inputs), so
the eager warm-up before a capture costs time, not correctness. Anything that fails to capture turns
graphs off for good: the eager path runs instead.
"""

from __future__ import annotations

import torch

from engine.models.v4.batch import ForwardBatch

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
PAGE_STEP = 8  # page tables padded to a multiple of this many pages (1,024 tokens of 128)
MAX_GRAPHS = 64


class DecodeGraphs:
    def __init__(self, model):
        self.model = model
        self.enabled = True
        self.graphs: dict[tuple, tuple] = {}  # (storage, batch, pages) -> graph and its static tensors
        self.error: str | None = None  # why graphs were turned off
        self._pool = None

    def clear(self) -> None:
        """Drop every graph and its memory pool (they are captured again when needed)."""
        self.graphs.clear()
        self._pool = None

    def run(self, input_ids: torch.Tensor, states: list, view_type) -> torch.Tensor | None:
        """Logits [B, vocab] of one decode step of `states` (token i for sequence i), replayed from a
        graph; None when no graph applies (then run eager). Does not advance num_tokens."""
        if not self.enabled or not input_ids.is_cuda:
            return None
        batch = next((b for b in BATCH_BUCKETS if b >= len(states)), None)
        if batch is None:
            return None
        padded = (batch, -(-view_type.pages_needed(states) // PAGE_STEP) * PAGE_STEP)
        key = (view_type.storage(states), *padded)  # a graph writes the storage it was captured with
        entry = self.graphs.get(key)
        if entry is None:
            if len(self.graphs) >= MAX_GRAPHS:
                return None
            try:
                entry = self._capture(padded, input_ids, states, view_type)
            except Exception as exc:  # noqa: BLE001 - any capture problem: eager from now on
                self.enabled, self.error = False, f"{type(exc).__name__}: {exc}"[:300]
                return None
            self.graphs[key] = entry
        graph, static_ids, static_meta, logits = entry
        self._fill(static_ids, static_meta, input_ids, states, padded, view_type)
        graph.replay()
        return logits[: len(states)].clone()

    @staticmethod
    def _fill(static_ids, static_meta, input_ids, states, key, view_type) -> None:
        static_ids[: input_ids.shape[0]].copy_(input_ids)
        static_meta.copy_(view_type.host_metadata(states, key), non_blocking=True)

    def _forward(self, static_ids: torch.Tensor, static_meta: torch.Tensor, states: list, key, view_type):
        model = self.model
        view = view_type(states, None, padded=key, meta=static_meta)
        positions = static_meta[:, 1]
        rope = {name: rotary.cos_sin(positions, model.dtype) for name, rotary in model.rotaries.items()}
        batch = ForwardBatch(static_ids, positions, [], [], rope, decode=view)
        return model.lm_head(model.model(batch))

    def _capture(self, key, input_ids, states, view_type) -> tuple:
        device = input_ids.device
        static_ids = torch.zeros(key[0], dtype=torch.long, device=device)
        static_meta = torch.zeros(key[0], 2 + key[1], dtype=torch.long, device=device)
        self._fill(static_ids, static_meta, input_ids, states, key, view_type)
        # warm-up on a side stream (lazy initialisations, allocator), as torch.cuda.graphs asks
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self._forward(static_ids, static_meta, states, key, view_type)
        torch.cuda.current_stream(device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = self._forward(static_ids, static_meta, states, key, view_type)
        return graph, static_ids, static_meta, logits
