"""DeepInfer's two-level equivalence check of bounded replay against a full recompute.

A prompt's first H tokens (a block multiple) are computed and cached; their window states are then
dropped (expired). The whole prompt is admitted again: the KV cache takes all H tokens' pages and
replays the last block (kv/manager.py). The same prompt is also computed from scratch.

Replay runs as the engine runs it, trimmed (the decoder side, docs/design/serving.md): the layers above the last
KV source see only the prompt's last 128 rows, from T = max(H - 128, L - 128), and only those rows
get logits.

Level 1 checks metadata: the hit, the replay start and the rows recomputed, the window each
replayed query may see (clamped at the replay start), the rows each part of the model ran on
(counted by hooks on the last KV source and the layer after it), that the cached pages were not
rewritten, and that no boundary state of the trimmed prefill entered the prefix cache.
Level 2 compares teacher-forced log-probabilities of the prompt's own next tokens, replay against
full recompute, on the rows that have logits: mean and max |delta logprob|, top-1 agreement and
top-5 overlap, separately for the replayed rows [T, H) and the rows after the hit [max(H, T), L - 1).
The same rows are reported for replay without trim, and for "no replay" (resume at H with empty
windows, what a hit without window state would give if it were taken as is), which scales them:
random weights make any window change look large, so the pass marks are relative.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.kv.manager import KVCache
from engine.scheduler.sequence import Sequence
from messages.common import SamplingParams
from messages.prefix import BLOCK_TOKENS

# Level-2 pass marks for the rows after the hit (where requests sample), relative to resuming there
# with empty windows; see README "Bounded replay".
THRESHOLDS = {"mean_abs_vs_no_replay": 0.5, "top1_not_below_no_replay": True}


@dataclass(slots=True)
class Agreement:
    rows: int = 0
    mean_abs: float = 0.0
    max_abs: float = 0.0
    top1: float = 1.0
    top5: float = 1.0

    @classmethod
    def between(cls, replay: torch.Tensor, full: torch.Tensor, targets: torch.Tensor) -> "Agreement":
        """Rows of logits [n, V] and the tokens they predict [n]."""
        if replay.shape[0] == 0:
            return cls()
        lp_r, lp_f = replay.float().log_softmax(-1), full.float().log_softmax(-1)
        delta = (lp_r.gather(1, targets[:, None]) - lp_f.gather(1, targets[:, None])).abs().squeeze(1)
        top5_r, top5_f = lp_r.topk(5, dim=-1).indices, lp_f.topk(5, dim=-1).indices
        overlap = (top5_r[:, :, None] == top5_f[:, None, :]).any(-1).float().mean(-1)
        return cls(rows=int(replay.shape[0]), mean_abs=float(delta.mean()), max_abs=float(delta.max()),
                   top1=float((top5_r[:, 0] == top5_f[:, 0]).float().mean()), top5=float(overlap.mean()))

    @classmethod
    def pooled(cls, parts: list["Agreement"]) -> "Agreement":
        rows = sum(p.rows for p in parts)
        if rows == 0:
            return cls()
        weigh = lambda name: sum(getattr(p, name) * p.rows for p in parts) / rows  # noqa: E731
        return cls(rows, weigh("mean_abs"), max(p.max_abs for p in parts), weigh("top1"), weigh("top5"))

    def passes_against(self, no_replay: "Agreement") -> bool:
        """Replay must at least halve the mean error of resuming without windows, and agree as often."""
        return (self.mean_abs <= THRESHOLDS["mean_abs_vs_no_replay"] * no_replay.mean_abs
                and self.top1 >= no_replay.top1)


@dataclass(slots=True)
class PromptCheck:
    length: int
    hit: int                      # H: cached tokens whose window expired
    trim_from: int = 0            # T: the first row the upper layers ran on
    metadata: dict[str, bool] = field(default_factory=dict)    # level 1, name -> held
    replayed: Agreement = field(default_factory=Agreement)     # rows [T, H) (none when T >= H)
    after: Agreement = field(default_factory=Agreement)        # rows [max(H, T), L - 1)
    untrimmed: Agreement = field(default_factory=Agreement)    # the same rows, replayed without trim
    no_replay: Agreement = field(default_factory=Agreement)    # the same rows, resumed at H without windows


def check_prompt(model, prompt: list[int], hit: int, model_id: str = "replay-check") -> PromptCheck:
    """Run both levels for one prompt whose first `hit` tokens (a block multiple >= 256) are cached."""
    if hit % BLOCK_TOKENS or hit < 2 * BLOCK_TOKENS or hit >= len(prompt):
        raise ValueError(f"hit {hit} must be a multiple of {BLOCK_TOKENS}, >= {2 * BLOCK_TOKENS}, below the prompt")
    config, device, dtype = model.config, model.device, model.dtype
    pages = -(-len(prompt) // BLOCK_TOKENS) * 3 + 2
    kv = KVCache(config, pages, 2, device, dtype, enable_prefix_cache=True, bounded_replay=True, replay_trim=True)
    length, start = len(prompt), hit - BLOCK_TOKENS
    trim_from = max(start, length - config.sliding_window)
    result = PromptCheck(length, hit, trim_from)
    meta = result.metadata

    # cache the first `hit` tokens (pages + window states), then let the window states expire
    first = _sequence("cached", prompt[:hit], model_id)
    kv.admit(first, kv.find_hit(first), hit)
    model([_ids(prompt[:hit], device)], [first.state], captures=[kv.capture_positions(first, hit)])
    first.num_computed = hit
    kv.commit(first)
    cached_pages = list(first.state.page_table)
    kv.release(first)
    kv.boundaries.states.clear()
    kv.boundaries.used_bytes = 0
    before = kv.pool.read_pages(cached_pages).clone()

    # the same prompt again: a replay hit, trimmed above the last KV source
    seq = _sequence("replayed", prompt, model_id)
    found = kv.find_hit(seq)
    meta["hit floored to the cached blocks"] = found.replay_end == hit
    meta["replay starts one block before the hit"] = found.tokens == start
    meta["the hit's pages are the cached pages"] = list(found.pages) == cached_pages
    kv.admit(seq, found, length - found.tokens)
    slot = seq.state.slot
    meta["state resumes at the replay start"] = seq.state.num_tokens == start and seq.num_computed == start
    lower = [layer for layer in range(config.num_layers) if layer not in kv.trimmed_layers]
    meta["replayed windows clamp at the replay start"] = all(
        kv.slots.read(slot, layer, p).shape[0] == min(config.sliding_window, p - start)
        for layer in lower for p in (start, start + 1, hit - 1, hit))
    meta["upper windows clamp at T = max(H - 128, L - 128)"] = seq.state.trim_from == trim_from and all(
        kv.slots.read(slot, layer, p).shape[0] == max(0, p - trim_from)
        for layer in kv.trimmed_layers for p in (start, trim_from, trim_from + 1, length))
    captures = kv.capture_positions(seq, length - start)
    meta["the trimmed prefill captures no boundary"] = captures == ()
    with _RowCounter(model) as counted:
        replay_logits = model([_ids(prompt[start:], device)], [seq.state], all_logits=True, captures=[captures])
    meta["rows recomputed up to the last KV source = L - H + 128"] = counted.lower == [length - start]
    upper_rows = [length - trim_from] if counted.has_upper else []
    meta["upper layers ran on the last 128 rows only"] = counted.upper == upper_rows
    meta["rows with logits = those the upper layers ran on"] = bool(
        (replay_logits.abs().sum(-1) > 0).tolist() == [p >= trim_from for p in range(start, length)])
    seq.num_computed = length
    kv.commit(seq)
    meta["no boundary state of a trimmed prefill was cached"] = len(kv.boundaries) == 0
    meta["cached compressed pages not rewritten"] = torch.equal(kv.pool.read_pages(cached_pages), before)
    kv.release(seq)

    # the same replay without trim (every layer on every replayed row)
    trimmed_layers, kv.trimmed_layers = kv.trimmed_layers, range(0)
    plain = _sequence("untrimmed", prompt, model_id)
    kv.admit(plain, found, length - found.tokens)
    plain_logits = model([_ids(prompt[start:], device)], [plain.state], all_logits=True)
    kv.release(plain)
    kv.trimmed_layers = trimmed_layers

    # no replay: resume at H with empty windows (what taking the hit as is would give)
    bare = _sequence("bare", prompt, model_id)
    kv.admit(bare, type(found)(hit, found.pages, replay_end=hit), length - hit)
    kv.slots.set_start(bare.state.slot, hit)
    bare_logits = model([_ids(prompt[hit:], device)], [bare.state], all_logits=True)
    kv.release(bare)

    full_logits = model([_ids(prompt, device)], [model.new_state()], all_logits=True)[start:]
    targets = torch.tensor(prompt[start + 1 :], device=replay_logits.device)
    # row r of the replay logits is position start + r; only rows from trim_from on have logits
    replayed = slice(trim_from - start, max(trim_from, hit) - start)
    after = slice(max(trim_from, hit) - start, length - 1 - start)
    result.replayed = Agreement.between(replay_logits[replayed], full_logits[replayed], targets[replayed])
    result.after = Agreement.between(replay_logits[after], full_logits[after], targets[after])
    result.untrimmed = Agreement.between(plain_logits[after], full_logits[after], targets[after])
    bare_after = slice(after.start - BLOCK_TOKENS, after.stop - BLOCK_TOKENS)  # bare row 0 is position H
    result.no_replay = Agreement.between(bare_logits[bare_after], full_logits[after], targets[after])
    return result


class _RowCounter:
    """Rows each forward sends through the last KV source (`lower`) and the layer after it (`upper`)."""

    def __init__(self, model):
        last = model.config.last_kv_source
        self.layers = model.layers[last], model.layers[last + 1] if last + 1 < len(model.layers) else None
        self.has_upper = self.layers[1] is not None
        self.lower, self.upper, self.hooks = [], [], []

    def __enter__(self) -> "_RowCounter":
        for layer, rows in zip(self.layers, (self.lower, self.upper)):
            if layer is not None:  # a block's first argument is its streams [rows, hc_mult, hidden]
                count = lambda _, args, rows=rows: rows.append(args[0].shape[0])  # noqa: E731
                self.hooks.append(layer.register_forward_pre_hook(count))
        return self

    def __exit__(self, *exc) -> None:
        for hook in self.hooks:
            hook.remove()


def sample_prompts(count: int, seed: int = 0, low: int = 100, high: int = 100_000) -> list[tuple[list[int], int]]:
    """Seeded (prompt, hit) pairs: hits of 2-4 blocks, 1-200 tokens after the hit (ordinary text ids)."""
    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(count):
        hit = BLOCK_TOKENS * int(torch.randint(2, 5, (1,), generator=generator))
        extra = int(torch.randint(1, 201, (1,), generator=generator))
        prompt = torch.randint(low, high, (hit + extra,), generator=generator).tolist()
        pairs.append((prompt, hit))
    return pairs


def _sequence(request_id: str, tokens: list[int], model_id: str) -> Sequence:
    return Sequence(request_id, list(tokens), len(tokens), SamplingParams(), model_id)


def _ids(tokens: list[int], device) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.long, device=device)
