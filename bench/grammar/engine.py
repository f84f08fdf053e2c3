"""Engine step time with grammar masks against the same batch without: EngineCore on the tiny model.

For each batch size B, two sides take turns round by round (so background load on a shared box falls
on both alike): `plain`, B requests decoding unconstrained, and `masked`, B requests each holding a
GrammarState of the same json_schema grammar (llguidance: the engine fills one bitmask row per
request, applies it to the logits, feeds each sampled token back). All requests share one short
prompt, sample at temperature 1 (seeded) and ignore EOS, so the plain side never stops; a masked
request whose grammar completes is replaced at once, and the step that prefills its replacement is
not timed. Timed: `EngineCore.step()` of pure decode steps of all B rows, the first one of each
window left out as a warm-up. After each timed masked step, outside its time, the grammar work of
the next step is timed on its own: `fill` (fill_bitmasks of the B live matchers, on the CPU) and
`apply` (the host-to-device copy and apply_token_bitmask_ on a [B, V] float32 logits tensor on the
engine's device), the engine's two calls; the matchers' accepts (microseconds) are left out. On
a model this small the step hides them; they are what a faster step would see.
"""
from __future__ import annotations

import itertools
import time
from pathlib import Path

import torch

from bench.stack.command import pick

PROMPT = [0, 128803, 4, 17, 300, 5000, 128804]   # BOS <｜User｜> ... <｜Assistant｜>
MAX_TOKENS = 4096


def measure_engine(model_dir: Path, tokenizer, grammar: str, batches: list[int], steps: int, rounds: int,
                   torch_threads: int, device: str = "cpu", dtype: str = "float32") -> list[dict]:
    from engine.engine_core import EngineConfig, EngineCore
    core = EngineCore(EngineConfig(model_dir=str(model_dir), device=device, dtype=dtype, num_pages=8 * max(batches) + 16,
                                   max_num_seqs=max(batches), enable_prefix_cache=False, swa_cache_bytes=0,
                                   torch_threads=torch_threads))
    ids = itertools.count()
    rows = []
    for batch in batches:
        samples = {"plain": [], "masked": []}
        fills, applies, replaced = [], [], 0
        for _ in range(rounds):
            for side in samples:
                make_grammar = (lambda: _state(tokenizer, grammar)) if side == "masked" else None
                times, work, window_replaced = _window(core, batch, steps, make_grammar, ids)
                samples[side] += times
                fills += [fill for fill, _ in work]
                applies += [apply for _, apply in work]
                replaced += window_replaced
        plain, masked = pick(samples["plain"], 0.5) * 1e3, pick(samples["masked"], 0.5) * 1e3
        rows.append({"batch": batch, "steps": len(samples["plain"]), "plain_ms": round(plain, 2),
                     "masked_ms": round(masked, 2), "ratio": round(masked / plain, 3),
                     "fill_ms": round(pick(fills, 0.5) * 1e3, 3), "apply_ms": round(pick(applies, 0.5) * 1e3, 3),
                     "plain_p90_ms": round(pick(samples["plain"], 0.9) * 1e3, 2),
                     "masked_p90_ms": round(pick(samples["masked"], 0.9) * 1e3, 2), "grammars_completed": replaced})
    return rows


def _state(tokenizer, grammar: str):
    from engine.grammar import GrammarState
    return GrammarState(tokenizer, grammar)


def _window(core, batch: int, steps: int, make_grammar, ids) -> tuple[list[float], list[tuple[float, float]], int]:
    """`steps` timed pure-decode steps of `batch` rows (after one warm-up), the grammar work timed
    apart after each (masked side), how many grammars completed."""
    from engine.engine_core import EngineRequest
    from messages.common import FinishReason, SamplingParams

    running: dict[str, object] = {}   # request id -> its GrammarState (None: plain)

    def add() -> None:
        n = next(ids)
        rid = f"grammar-bench-{n}"
        sampling = SamplingParams(temperature=1.0, seed=n, max_tokens=MAX_TOKENS, ignore_eos=True)
        running[rid] = make_grammar() if make_grammar else None
        core.add_request(EngineRequest(rid, list(PROMPT), sampling, grammar=running[rid]))

    for _ in range(batch):
        add()
    logits = torch.zeros(batch, core.model.config.vocab_size, device=core.model.device) if make_grammar else None
    times, masks, completed, clean, tries = [], [], 0, False, 0
    while len(times) < steps + 1:
        tries += 1
        if tries > 4 * (steps + 2):
            raise RuntimeError(f"grammars complete too fast to time {steps} full steps of {batch} rows")
        started = time.perf_counter()
        outputs = core.step()   # ends with the sampled ids read back to the host: the device is done
        elapsed = time.perf_counter() - started
        finished = [o for o in outputs if o.finish_reason is not None]
        if clean and len(outputs) == batch and all(len(o.new_token_ids) == 1 for o in outputs):
            times.append(elapsed)
            if logits is not None and not finished:
                masks.append(_mask_work([running[o.request_id] for o in outputs], logits))
        for out in finished:
            if out.finish_reason == FinishReason.ERROR:
                raise RuntimeError(f"{out.request_id}: the grammar rejected a sampled token (the mask failed)")
            del running[out.request_id]
            completed += 1
            add()
        clean = not finished
    for rid in running:
        core.abort(rid)
    return times[1:], masks[1:], completed


def _mask_work(states: list, logits) -> tuple[float, float]:
    """Seconds of the engine's grammar calls for one step: (fill the B rows, apply them to the logits)."""
    from engine.grammar.mask import apply_token_bitmask_, fill_bitmasks
    started = time.perf_counter()
    bitmask = fill_bitmasks(states, logits.shape[1])
    filled = time.perf_counter()
    apply_token_bitmask_(logits, bitmask.to(logits.device))
    if logits.is_cuda:
        torch.cuda.synchronize(logits.device)
    return filled - started, time.perf_counter() - filled
