"""Runs one scheduled step: the model forward over the scheduled chunks, then sampling.

Batched mode packs every chunk into one forward. Batch-invariant mode runs one forward per
sequence, so a sequence's numerics never see the other rows (the scheduler keeps its chunks
independent of the batch too). Rows whose grammar is active get its token bitmask applied to their
logits before sampling (engine/grammar/); a batch without one does no mask work at all. A row that
spent its thinking budget gets its end-of-thinking token forced the same way (sampling/thinking.py).
"""

from __future__ import annotations

import torch

from engine.grammar.mask import apply_token_bitmask_, fill_bitmasks
from engine.kv.manager import KVCache
from engine.models.spec import ModelSpec
from engine.sampling import SampleResult, sample, seed_step
from engine.sampling.logprobs import chosen_logprobs, raw_logprobs, top_logprobs
from engine.sampling.thinking import force_tokens_, forced_think_end
from engine.scheduler.sequence import Sequence
from messages.common import SamplingParams


class ModelRunner:
    def __init__(self, model: ModelSpec, kv: KVCache, batch_invariant: bool = False):
        self.model, self.kv, self.batch_invariant = model, kv, batch_invariant

    def run(self, scheduled: list[tuple[Sequence, int]]) -> tuple[list[Sequence], SampleResult | None]:
        """Advance each scheduled sequence by its chunk; sample for those whose tokens are all in.

        Returns the sequences that got a token and the sample (rows in that order).
        """
        logits = self._forward(scheduled)
        # Grammar masks are filled on the CPU here, while an accelerator may still run the forward.
        bitmask = self._grammar_bitmask(scheduled, logits.shape[-1])
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
        params = [s.sampling for s in seqs]
        unmasked = None
        forced = [(row, token) for row, seq in enumerate(seqs) if (token := forced_think_end(seq)) is not None]
        if bitmask is not None or forced:
            if any(p.logprobs or p.top_logprobs for p in params):
                unmasked = rows.clone()   # logprobs are reported under the model's raw distribution
            if bitmask is not None:
                apply_token_bitmask_(rows, bitmask)   # one host-to-device copy inside
            force_tokens_(rows, forced)
        for seq in seqs:   # the draw for output token k depends on (seed, k) only: hand-offs and resumes match
            if seq.generator is not None:
                seed_step(seq.generator, seq.sampling.seed, seq.sampling.step_offset + seq.num_generated)
        result = sample(rows, params, [s.generator for s in seqs])
        if unmasked is not None:
            _report_unmasked_logprobs(result, unmasked, params)
        return seqs, result

    @staticmethod
    def _grammar_bitmask(scheduled: list[tuple[Sequence, int]], vocab_size: int) -> torch.Tensor | None:
        """The ready rows' token bitmask (CPU), or None when no ready row has an active grammar."""
        states = [seq.grammar for seq, count in scheduled if seq.num_computed + count == len(seq.token_ids)]
        if not any(state is not None and state.active for state in states):
            return None
        return fill_bitmasks(states, vocab_size)

    def _forward(self, scheduled: list[tuple[Sequence, int]]) -> torch.Tensor:
        device = self.model.device
        tokens, counts, states, captures = [], [], [], []
        for seq, count in scheduled:
            tokens.extend(seq.token_ids[seq.num_computed : seq.num_computed + count])
            counts.append(count)
            states.append(seq.state)
            captures.append(self.kv.capture_positions(seq, count))
        chunks = list(torch.tensor(tokens, dtype=torch.long).to(device).split(counts))  # one host-to-device copy
        embeds = [image_rows(seq, seq.num_computed, count, device) for seq, count in scheduled]
        extra = {"embeds": embeds} if any(e is not None for e in embeds) else {}
        if not self.batch_invariant:
            return self.model(chunks, states, captures=captures, **extra)
        return torch.cat([self.model([c], [s], captures=[p], **({"embeds": [e]} if e is not None else {}))
                          for c, s, p, e in zip(chunks, states, captures, embeds)])


def image_rows(seq: Sequence, start: int, count: int, device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The image embedding rows falling in the chunk [start, start + count) of `seq`, as the model's
    `embeds` pair (offsets within the chunk, rows), or None when the chunk has no image token."""
    offsets, rows = [], []
    for image, embeds in zip(seq.images, seq.image_embeds):
        lo, hi = max(image.start, start), min(image.end, start + count)
        if lo >= hi:
            continue
        if embeds is None:   # the scheduler admits no chunk that needs a missing image
            raise RuntimeError(f"{seq.request_id}: image at {image.start} has no embeddings")
        offsets.append(torch.arange(lo - start, hi - start))
        rows.append(embeds[lo - image.start : hi - image.start])
    if not rows:
        return None
    return torch.cat(offsets).to(device), torch.cat([r.to(device) for r in rows])


def _report_unmasked_logprobs(result: SampleResult, logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """Replace the logprobs `sample` computed from grammar-masked (or forced) logits with those of the unmasked
    ones: the mask shapes the draw, like top-k, not the reported numbers (sampling/logprobs.py)."""
    logprobs = raw_logprobs(logits)
    if result.logprobs is not None:
        result.logprobs = chosen_logprobs(logprobs, result.token_ids)
    if result.top_logprobs is not None:
        result.top_logprobs = [top_logprobs(logprobs[i], p.top_logprobs) for i, p in enumerate(params)]
