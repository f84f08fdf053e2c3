"""One decoding step's token choice for a batch: greedy or temperature / top-k / top-p sampling.

Batch invariance: a row's token depends only on its own logits, its own params and its own
generator, never on the other rows or the batch size. Filtering is vectorised but purely
row-wise (elementwise ops, per-row sort / softmax / cumsum), and the random draw is one
exponential race per row: token = argmax(p_i / E_i) with E_i ~ Exp(1) drawn from that row's
generator (the Gumbel-max trick, done in log space). A sampled row consumes exactly V
exponentials from its generator per step whatever its top-k / top-p; a greedy row consumes none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.sampling.logprobs import chosen_logprobs, raw_logprobs, top_logprobs
from messages.common import SamplingParams

# Below this temperature a row is greedy: logits / T would only overflow, and the draw is an argmax anyway.
GREEDY_TEMPERATURE = 1e-5
MAX_TOP_LOGPROBS = 20
_SEED_MASK = (1 << 64) - 1


@dataclass(slots=True)
class SampleResult:
    """token_ids: [B] int64 on the logits' device.

    logprobs: when any row asked for logprobs (or top_logprobs), the raw log-prob of each row's
    chosen token (see logprobs.py), one entry per row; otherwise None.
    top_logprobs: when any row asked for top_logprobs, per row its top-N (token_id, logprob),
    most likely first, N = params[i].top_logprobs ([] for rows that asked for none); otherwise None.
    """

    token_ids: torch.Tensor
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


def validate_sampling_params(params: SamplingParams, where: str = "sampling") -> None:
    """Raise ValueError naming the first bad field (NaN fails every range check)."""
    t = params.temperature
    if not (math.isfinite(t) and t >= 0):
        raise ValueError(f"{where}.temperature must be finite and >= 0, got {t!r}")
    if not (0 < params.top_p <= 1):
        raise ValueError(f"{where}.top_p must be in (0, 1], got {params.top_p!r}")
    if params.top_k < 0:
        raise ValueError(f"{where}.top_k must be >= 0 (0 = off), got {params.top_k!r}")
    if isinstance(params.step_offset, bool) or not isinstance(params.step_offset, int) or params.step_offset < 0:
        raise ValueError(f"{where}.step_offset must be an int >= 0, got {params.step_offset!r}")
    if params.thinking_budget < -1 or (params.thinking_budget >= 0 and params.think_end_id < 0):
        raise ValueError(f"{where}.thinking_budget must be -1 (off) or >= 0 with a think_end_id, got "
                         f"{params.thinking_budget!r} and {params.think_end_id!r}")
    if not (0 <= params.top_logprobs <= MAX_TOP_LOGPROBS):
        raise ValueError(f"{where}.top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {params.top_logprobs!r}")


def make_generator(seed: int | None, request_id: str, device: str | torch.device = "cpu") -> torch.Generator | None:
    """The per-request generator to pass to sample(), on the device the logits live on.

    With a seed the stream depends on the seed alone (request_id does not enter it), so two
    requests with the same seed, prompt and params sample the same tokens, as OpenAI's `seed`
    promises. seed None -> None: that request's draws come from torch's global RNG and are not
    reproducible. request_id only labels errors.
    """
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"request {request_id}: seed must be an int or None, got {seed!r}")
    generator = torch.Generator(device=device)
    generator.manual_seed(seed & _SEED_MASK)
    return generator


def seed_step(generator: torch.Generator, seed: int, step: int) -> None:
    """Seed `generator` for output token `step` of a request seeded with `seed`.

    Each output token's draw depends on (seed, step) alone, not on how many draws came before
    it in this process: a request handed from prefill to decode, or resumed on another worker
    after a failure (SamplingParams.step_offset), samples exactly what an uninterrupted run would.
    """
    mixed = (seed & _SEED_MASK) ^ ((step + 1) * 0x9E3779B97F4A7C15 & _SEED_MASK)   # splitmix64 finaliser
    mixed = ((mixed ^ (mixed >> 30)) * 0xBF58476D1CE4E5B9) & _SEED_MASK
    mixed = ((mixed ^ (mixed >> 27)) * 0x94D049BB133111EB) & _SEED_MASK
    generator.manual_seed(mixed ^ (mixed >> 31))


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> SampleResult:
    """Choose one token per row of logits [B, V] (any float dtype; computed in fp32).

    Greedy rows (temperature < GREEDY_TEMPERATURE) take the argmax, ties to the lowest id. Other
    rows apply temperature, then top-k, then top-p (on the top-k-renormalised distribution), then
    draw with their generator (None = global RNG).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    if not (len(params) == len(generators) == logits.shape[0]):
        raise ValueError(f"{logits.shape[0]} logit rows, {len(params)} params, {len(generators)} generators")
    for i, p in enumerate(params):
        validate_sampling_params(p, f"params[{i}]")

    logits = logits.float()
    token_ids = logits.argmax(dim=-1)  # documented: the first maximal index, i.e. the lowest id
    rows = [i for i, p in enumerate(params) if p.temperature >= GREEDY_TEMPERATURE]
    if rows:
        index = torch.tensor(rows, device=logits.device)
        drawn = _draw(logits[index], [params[i] for i in rows], [generators[i] for i in rows])
        token_ids[index] = drawn
    return _attach_logprobs(SampleResult(token_ids), logits, params)


def _draw(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> torch.Tensor:
    device, vocab = logits.device, logits.shape[1]
    temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    scaled = _filter_top_k_top_p(logits / temperature, [p.top_k for p in params], [p.top_p for p in params])
    # One row at a time so a row's noise is the same whatever tensor it would otherwise share.
    race = torch.stack([torch.empty(vocab, device=device).exponential_(generator=g) for g in generators])
    tiny = torch.finfo(torch.float32).tiny  # exponential_ never returns 0; the clamp just keeps log finite
    return (scaled - race.clamp_min_(tiny).log_()).argmax(dim=-1)


def _filter_top_k_top_p(scaled: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Set to -inf every token outside a row's top-k, then outside its nucleus.

    Both work on one stable descending sort, so ties are ordered lowest id first: top-k keeps
    exactly k tokens and the nucleus is the shortest prefix with probability mass >= top_p. The
    most likely token always survives.
    """
    rows, vocab = scaled.shape
    k = [kk if 0 < kk < vocab else vocab for kk in top_k]
    if all(kk == vocab for kk in k) and all(pp >= 1.0 for pp in top_p):
        return scaled
    device = scaled.device
    values, ids = torch.sort(scaled, dim=-1, descending=True, stable=True)
    position = torch.arange(vocab, device=device)
    drop = position >= torch.tensor(k, device=device).unsqueeze(1)
    values = values.masked_fill(drop, -math.inf)

    probs = torch.softmax(values, dim=-1)
    mass_before = torch.cat([probs.new_zeros(rows, 1), probs.cumsum(dim=-1)[:, :-1]], dim=1)
    nucleus = torch.tensor([pp if pp < 1.0 else math.inf for pp in top_p], device=device).unsqueeze(1)
    drop |= mass_before >= nucleus
    drop[:, 0] = False
    return torch.full_like(scaled, -math.inf).scatter_(1, ids, values.masked_fill(drop, -math.inf))


def _attach_logprobs(result: SampleResult, logits: torch.Tensor, params: list[SamplingParams]) -> SampleResult:
    want_top = any(p.top_logprobs > 0 for p in params)
    if not (want_top or any(p.logprobs for p in params)):
        return result
    logprobs = raw_logprobs(logits)
    result.logprobs = chosen_logprobs(logprobs, result.token_ids)
    if want_top:
        result.top_logprobs = [top_logprobs(logprobs[i], p.top_logprobs) for i, p in enumerate(params)]
    return result
