"""Continuous batching: which sequences run in the next forward, and how many tokens each.

Every step mixes decode tokens and prefill chunks under `max_batched_tokens` and `max_num_seqs`.
Running sequences go first, oldest first; each takes what it still needs (one token when
decoding, the rest of its prompt up to the remaining budget when prefilling). When pages run out
the newest running sequence is preempted: its state is freed and it goes back to the head of
`waiting`, to be recomputed (full blocks stay cached, so recomputing often hits). Waiting
sequences are admitted in arrival order while budget, slots and pages last, and not in a step
that preempted.

Prefill-only sequences (the P of an E/P/D split) leave `running` once their first token is
sampled: they are HELD (state and pages kept, never scheduled or preempted) until the engine
snapshots and releases them, or aborts them.

Batch-invariant mode fixes each sequence's chunks independently of the batch: prefill chunks
end on the 128-token grid (a chunk waits for a step with room rather than being cut short).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection

from engine.kv.manager import KVCache
from engine.scheduler.sequence import Sequence, SequenceStatus
from messages.common import FinishReason
from messages.prefix import BLOCK_TOKENS

INVARIANT_CHUNK = BLOCK_TOKENS   # batch-invariant prefill chunks end on the block grid


class Scheduler:
    def __init__(self, kv: KVCache, max_num_seqs: int, max_batched_tokens: int, max_len: int,
                 eos_token_ids: Collection[int], batch_invariant: bool = False):
        self.kv = kv
        self.max_num_seqs, self.max_batched_tokens = max_num_seqs, max_batched_tokens
        self.max_len = max_len
        self.eos_token_ids = frozenset(eos_token_ids)  # any of them finishes a request (unless ignore_eos)
        self.batch_invariant = batch_invariant
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.held: dict[str, Sequence] = {}  # prefill-only sequences waiting for hand-off
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0
        self.failed: list[Sequence] = []   # finished ERROR at admission; the engine reports them next

    def is_finished(self) -> bool:
        return not self.waiting and not self.running and not self.failed

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop an unfinished or held sequence (abort, release) and free its KV."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.HELD:
            del self.held[seq.request_id]
        else:
            self.waiting.remove(seq)
        self.kv.release(seq)
        seq.status = SequenceStatus.FINISHED

    def schedule(self) -> list[tuple[Sequence, int]]:
        scheduled, budget, preempted = [], self.max_batched_tokens, False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            count = self._chunk(seq, seq.num_computed, budget)
            if count == 0:
                i += 1
                continue
            while not self.kv.can_append(seq, count):
                preempted = True
                self._preempt(self.running[-1])
                if i >= len(self.running):  # seq itself was the newest
                    break
            else:
                self.kv.append(seq, count)
                scheduled.append((seq, count))
                budget -= count
                i += 1
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hit = self.kv.find_hit(seq)
            if seq.images and seq.missing_image_before(hit.tokens) is not None:
                self._fail_missing_image(seq, hit.tokens)
                continue
            count = self._chunk(seq, hit.tokens, budget)
            if count == 0 or not self.kv.can_admit(seq, hit, count):
                break
            self.waiting.popleft()
            self.kv.admit(seq, hit, count)
            if hit.page_data is None and hit.tokens:
                self.prefix_hit_tokens += hit.tokens
                if not seq.num_preemptions:
                    seq.num_cached_tokens = hit.tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append((seq, count))
            budget -= count
        return scheduled

    def _chunk(self, seq: Sequence, start: int, budget: int) -> int:
        """Tokens `seq` runs next when its state holds `start` tokens; 0 = not this step."""
        remaining = len(seq.token_ids) - start
        if not self.batch_invariant:
            return min(remaining, budget)
        count = min(remaining, INVARIANT_CHUNK - start % INVARIANT_CHUNK)
        return count if count <= budget else 0

    def _fail_missing_image(self, seq: Sequence, start: int) -> None:
        """Its computation would start at `start`, before an image the caller gave no embeddings for
        (it expected a longer prefix hit, or a preemption lost the cached blocks): computing the span
        from the placeholder id's own embedding would be a silent wrong answer, so the request fails."""
        self.waiting.popleft()
        seq.finish_reason = FinishReason.ERROR
        seq.status = SequenceStatus.FINISHED
        self.failed.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.release(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, seq: Sequence, token_id: int, logprob=None, top=None) -> None:
        """Append a sampled token; finish the sequence (and free its KV) on a stop condition;
        otherwise hold a prefill-only sequence (its KV stays) instead of decoding on."""
        seq.append(token_id, logprob, top)
        reason = self._grammar_reason(seq, token_id) or self._stop_reason(seq, token_id)
        if reason is not None:
            seq.finish_reason = reason
            self.running.remove(seq)
            self.kv.release(seq)
            seq.status = SequenceStatus.FINISHED
        elif seq.prefill_only:
            self.running.remove(seq)
            seq.status = SequenceStatus.HELD
            self.held[seq.request_id] = seq

    @staticmethod
    def _grammar_reason(seq: Sequence, token_id: int) -> FinishReason | None:
        """ERROR when the grammar rejects a sampled token (the mask should have made that impossible);
        STOP once the grammar is complete, since only EOS may follow (the step it would take is saved)."""
        if seq.grammar is None:
            return None
        if not seq.grammar.accept(token_id):
            return FinishReason.ERROR
        return FinishReason.STOP if seq.grammar.done else None

    def _stop_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        params = seq.sampling
        if token_id in self.eos_token_ids and not params.ignore_eos:
            return FinishReason.STOP
        if token_id in params.stop_token_ids:
            return FinishReason.STOP
        if seq.num_generated >= params.max_tokens or len(seq.token_ids) >= self.max_len:
            return FinishReason.LENGTH
        return None
