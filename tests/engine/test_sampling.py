"""engine.sampling: greedy, seeded sampling, top-k / top-p, batch invariance, raw logprobs, validation."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampling import SampleResult, make_generator, sample, validate_sampling_params
from messages.common import SamplingParams

VOCAB = 64
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _logits(batch: int, seed: int = 0, vocab: int = VOCAB, device: str = "cpu") -> torch.Tensor:
    return (torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3).to(device)


def _draws(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """n sequential draws for one row from one seeded generator."""
    g = make_generator(seed, "r", logits.device)
    return torch.cat([sample(logits.view(1, -1), [params], [g]).token_ids for _ in range(n)]).cpu()


def test_greedy_is_argmax_with_ties_to_lowest_id():
    logits = _logits(4)
    logits[1, [5, 17, 40]] = 100.0
    logits[2, :] = 0.0
    result = sample(logits, [SamplingParams()] * 4, [None] * 4)
    assert isinstance(result, SampleResult) and result.token_ids.dtype == torch.int64
    expected = logits.argmax(dim=-1)
    expected[1], expected[2] = 5, 0
    assert torch.equal(result.token_ids, expected)
    assert result.logprobs is None and result.top_logprobs is None


def test_greedy_rows_ignore_generators_and_top_k_top_p():
    logits = _logits(3)
    params = [SamplingParams(top_k=5, top_p=0.5, seed=1)] * 3
    result = sample(logits, params, [make_generator(i, "r") for i in range(3)])
    assert torch.equal(result.token_ids, logits.argmax(dim=-1))


def test_make_generator_seeded_is_deterministic_and_none_means_global():
    assert make_generator(None, "r") is None
    a, b = make_generator(7, "a"), make_generator(7, "b")
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))
    assert make_generator(-1, "r").initial_seed() == (1 << 64) - 1
    with pytest.raises(ValueError, match="seed"):
        make_generator("7", "r")  # type: ignore[arg-type]


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_sampling_is_reproducible(device):
    logits = _logits(1, device=device)[0]
    params = SamplingParams(temperature=1.0, seed=3)
    first = _draws(logits, params, 50, seed=3)
    assert torch.equal(first, _draws(logits, params, 50, seed=3))
    assert not torch.equal(first, _draws(logits, params, 50, seed=4))
    assert len(set(first.tolist())) > 1


@pytest.mark.parametrize(
    "device, vocab", [("cpu", VOCAB)] + [("cuda", v) for v in (VOCAB, 129280) if "cuda" in DEVICES]
)
@pytest.mark.parametrize("position", [0, 3, 7])
def test_sampled_token_is_batch_invariant(position, device, vocab):
    target_logits = _logits(1, seed=99, vocab=vocab, device=device)[0]
    target = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=42, logprobs=True, top_logprobs=3)
    others = [
        SamplingParams(),
        SamplingParams(temperature=1.5, seed=1),
        SamplingParams(temperature=0.7, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.3, seed=2, logprobs=True),
        SamplingParams(temperature=2.0, top_k=50, top_p=0.95, seed=3, top_logprobs=20),
        SamplingParams(temperature=0.5, seed=4),
        SamplingParams(temperature=1.0, top_k=1),
    ]
    steps = 6
    alone_g = make_generator(42, "alone", device)
    alone = [sample(target_logits.view(1, -1), [target], [alone_g]) for _ in range(steps)]

    batch_g = make_generator(42, "batched", device)
    other_gs = [make_generator(p.seed, f"o{i}", device) for i, p in enumerate(others)]
    for step in range(steps):
        rows = list(_logits(7, seed=step + 10, vocab=vocab, device=device).unbind())
        params, gens = list(others), list(other_gs)
        rows.insert(position, target_logits)
        params.insert(position, target)
        gens.insert(position, batch_g)
        batched = sample(torch.stack(rows), params, gens)
        assert batched.token_ids[position] == alone[step].token_ids[0]
        assert batched.logprobs[position] == alone[step].logprobs[0]
        assert batched.top_logprobs[position] == alone[step].top_logprobs[0]
    assert len({r.token_ids.item() for r in alone}) > 1


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_one_and_tiny_top_p_are_greedy_even_with_ties(device):
    logits = _logits(6, seed=5, device=device)
    logits[0, [9, 3]] = 50.0  # tie: greedy picks 3
    greedy = sample(logits, [SamplingParams()] * 6, [None] * 6).token_ids
    for params in (SamplingParams(temperature=1.3, top_k=1), SamplingParams(temperature=1.3, top_p=1e-6)):
        gens = [make_generator(i, "r", device) for i in range(6)]
        for _ in range(5):
            assert torch.equal(sample(logits, [params] * 6, gens).token_ids, greedy)
    assert greedy[0] == 3


def test_top_k_restricts_to_the_k_most_likely():
    logits = torch.tensor([1.0, 4.0, 0.0, 3.0, 2.0])
    drawn = set(_draws(logits, SamplingParams(temperature=5.0, top_k=2), 300).tolist())
    assert drawn == {1, 3}


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    assert set(_draws(logits, SamplingParams(temperature=1.0, top_p=0.75), 300).tolist()) == {0, 1}
    assert set(_draws(logits, SamplingParams(temperature=1.0, top_p=0.45), 50).tolist()) == {0}
    assert set(_draws(logits, SamplingParams(temperature=1.0, top_p=1.0), 300).tolist()) == {0, 1, 2}


def test_top_p_applies_after_top_k_renormalisation():
    # Raw probs 0.4 / 0.3 / 0.3: top_p 0.55 alone keeps {0, 1}; after top_k=2 (0.571 / 0.429) only {0}.
    logits = torch.tensor([0.4, 0.3, 0.3]).log()
    assert set(_draws(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.55), 50).tolist()) == {0}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature, p_second", [(1.0, 0.75), (2.0, math.sqrt(3) / (1 + math.sqrt(3))), (0.5, 0.9)])
def test_temperature_reshapes_the_distribution(temperature, p_second, device):
    logits = torch.tensor([0.0, math.log(3.0)], device=device)  # p = 0.25 / 0.75 at temperature 1
    draws = _draws(logits, SamplingParams(temperature=temperature), 2000, seed=1234)
    assert abs(draws.float().mean().item() - p_second) < 0.04  # ~4 standard deviations


def test_masked_tokens_are_never_sampled():
    logits = _logits(1, seed=8)[0]
    logits[VOCAB // 2 :] = -math.inf
    drawn = _draws(logits, SamplingParams(temperature=3.0, top_p=0.99), 200)
    assert drawn.max() < VOCAB // 2


def test_logprobs_are_raw_log_softmax_at_the_chosen_ids():
    logits = _logits(4, seed=6)
    params = [
        SamplingParams(temperature=2.0, top_k=5, logprobs=True),
        SamplingParams(),
        SamplingParams(temperature=0.3, top_p=0.5),
        SamplingParams(logprobs=True),
    ]
    result = sample(logits, params, [make_generator(i, "r") for i in range(4)])
    raw = torch.log_softmax(logits, dim=-1)
    expected = raw.gather(1, result.token_ids.view(-1, 1)).view(-1)
    assert torch.allclose(torch.tensor(result.logprobs), expected)
    assert result.top_logprobs is None


def test_top_logprobs_are_sorted_correct_and_only_where_requested():
    logits = _logits(3, seed=7)
    logits[2, [11, 4, 30]] = 20.0  # three-way tie at the top: ids ascending
    params = [SamplingParams(top_logprobs=5), SamplingParams(temperature=1.0), SamplingParams(top_logprobs=20)]
    result = sample(logits, params, [None] * 3)
    raw = torch.log_softmax(logits, dim=-1)
    assert result.top_logprobs[1] == [] and len(result.logprobs) == 3
    for row, n in ((0, 5), (2, 20)):
        top = result.top_logprobs[row]
        ids, values = [t for t, _ in top], [v for _, v in top]
        assert len(top) == n and values == sorted(values, reverse=True)
        assert torch.equal(torch.tensor(values), raw[row, ids])
        assert values[-1] >= raw[row].sort(descending=True).values[n - 1].item()
    assert [t for t, _ in result.top_logprobs[2][:3]] == [4, 11, 30]
    assert result.top_logprobs[0][0][0] == result.token_ids[0].item()


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_logits_work(device):
    logits = _logits(3, seed=9, device=device).to(torch.bfloat16)
    params = [
        SamplingParams(logprobs=True, top_logprobs=2),
        SamplingParams(temperature=1.0, top_k=10, seed=1, logprobs=True),
        SamplingParams(temperature=0.7, top_p=0.8),
    ]
    result = sample(logits, params, [None, make_generator(1, "r", device), make_generator(2, "r", device)])
    assert result.token_ids[0] == logits.float().argmax(dim=-1)[0]
    raw = torch.log_softmax(logits.float(), dim=-1).cpu()
    assert torch.allclose(torch.tensor(result.logprobs), raw.gather(1, result.token_ids.cpu().view(-1, 1)).view(-1))


def test_unseeded_rows_draw_from_the_global_rng():
    logits = _logits(2, seed=10)
    params = [SamplingParams(temperature=1.0)] * 2
    torch.manual_seed(0)
    first = sample(logits, params, [None, None]).token_ids
    torch.manual_seed(0)
    assert torch.equal(first, sample(logits, params, [None, None]).token_ids)


@pytest.mark.parametrize(
    "field, bad",
    [
        ("temperature", -0.1), ("temperature", math.inf), ("temperature", math.nan),
        ("top_p", 0.0), ("top_p", 1.5), ("top_p", math.nan),
        ("top_k", -1), ("top_logprobs", -1), ("top_logprobs", 21),
    ],
)
def test_invalid_params_raise_naming_the_field(field, bad):
    params = SamplingParams(**{field: bad})
    with pytest.raises(ValueError, match=rf"params\[1\]\.{field}"):
        sample(_logits(2), [SamplingParams(), params], [None, None])
    with pytest.raises(ValueError, match=field):
        validate_sampling_params(params)


def test_mismatched_shapes_raise():
    with pytest.raises(ValueError, match="batch, vocab"):
        sample(torch.zeros(VOCAB), [SamplingParams()], [None])
    with pytest.raises(ValueError, match="generators"):
        sample(_logits(2), [SamplingParams()] * 2, [None])
