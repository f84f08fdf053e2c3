"""Runs one scheduled step: the model forward over the scheduled chunks, then sampling.

Batched mode packs every chunk into one forward. Batch-invariant mode runs one forward per
sequence, so a sequence's numerics never see the other rows (the scheduler keeps its chunks
independent of the batch too).
"""

from __future__ import annotations

import torch

from engine.kv.manager import KVCache
from engine.model.model import DeepseekV4
from engine.sampling import SampleResult, sample, seed_step
from engine.scheduler.sequence import Sequence


class ModelRunner:
    def __init__(self, model: DeepseekV4, kv: KVCache, batch_invariant: bool = False):
        self.model, self.kv, self.batch_invariant = model, kv, batch_invariant

    def run(self, scheduled: list[tuple[Sequence, int]]) -> tuple[list[Sequence], SampleResult | None]:
        """Advance each scheduled sequence by its chunk; sample for those whose tokens are all in.

        Returns the sequences that got a token and the sample (rows in that order).
        """
        logits = self._forward(scheduled)
        ready = []
        for row, (seq, count) in enumerate(scheduled):
            seq.num_computed += count
            if seq.state.num_tokens != seq.num_computed:
                raise RuntimeError(f"{seq.request_id}: state holds {seq.state.num_tokens} tokens, "
                                   f"expected {seq.num_computed}")
            self.kv.commit(seq)
            if seq.num_computed == len(seq.token_ids):
                ready.append(row)
        if not ready:
            return [], None
        seqs = [scheduled[row][0] for row in ready]
        rows = logits if len(ready) == len(scheduled) else logits[torch.tensor(ready, device=logits.device)]
        rows = rows.float()
        for seq in seqs:   # the draw for output token k depends on (seed, k) only: hand-offs and resumes match
            if seq.generator is not None:
                seed_step(seq.generator, seq.sampling.seed, seq.sampling.step_offset + seq.num_generated)
        return seqs, sample(rows, [s.sampling for s in seqs], [s.generator for s in seqs])

    def _forward(self, scheduled: list[tuple[Sequence, int]]) -> torch.Tensor:
        device = self.model.device
        tokens, counts, states, captures = [], [], [], []
        for seq, count in scheduled:
            tokens.extend(seq.token_ids[seq.num_computed : seq.num_computed + count])
            counts.append(count)
            states.append(seq.state)
            captures.append(self.kv.capture_positions(seq, count))
        chunks = list(torch.tensor(tokens, dtype=torch.long).to(device).split(counts))  # one host-to-device copy
        if not self.batch_invariant:
            return self.model(chunks, states, captures=captures)
        return torch.cat([self.model([c], [s], captures=[p]) for c, s, p in zip(chunks, states, captures)])
