"""Our model against transformers' DeepseekV4ForCausalLM (fp32, random weights, tiny shapes).

Prompt logits are compared with a reference full-sequence forward. Decode steps are compared
with the reference decoding incrementally through its own cache, fed our tokens: when its
argmax at every step is our token, its greedy continuation is ours. Two reference paths are
avoided on purpose: `generate` (transformers 5.24 builds a 127-token sliding window there; its
forward and the paper use 128), and full-sequence forwards for decode steps (the indexer's top-k
is discontinuous: a near-tie flips between a 1-token and a whole-sequence computation, in the
reference itself as in ours).
"""

from __future__ import annotations

import json

import pytest
import torch

from engine.models.v4 import load_model
from engine.models.v4.config import read_config_dict
from engine.models.v4.generate import decode_greedy, prefill
from engine.models.v4.random_init import write_random_model_dir
from tests.engine.references import make_prompt, rel_err

SEEDS = (0, 1)
PROMPT_LENGTHS = (1, 127, 128, 129, 300, 1000)
NEW_TOKENS = 64
TOLERANCE = 1e-4


def decode_with_logits(model, state, logits, steps):
    tokens, step_logits = [], [logits]
    for step in range(steps):
        tokens.append(int(step_logits[-1].argmax()))
        if step + 1 < steps:
            step_logits.append(model([torch.tensor(tokens[-1:])], [state])[0])
    return tokens, torch.stack(step_logits)


def reference_logits(reference, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return reference(tokens[None], use_cache=False).logits[0]


def reference_decode_logits(reference, prompt: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """Reference logits after the prompt and after each of `tokens`, decoding through its cache."""
    with torch.no_grad():
        out = reference(prompt[None], use_cache=True)
        cache, logits = out.cache, [out.logits[0, -1]]
        for token in tokens:
            out = reference(torch.tensor([[token]]), cache=cache, use_cache=True)
            logits.append(out.logits[0, -1])
    return torch.stack(logits)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_prefill_logits_and_greedy_continuation_match_reference(tiny_model, reference_model, seed, length):
    model, reference = tiny_model(seed), reference_model(seed)
    prompt = make_prompt(length, seed)
    state = model.new_state()
    prompt_logits = model([prompt], [state], all_logits=True)
    generated, step_logits = decode_with_logits(model, state, prompt_logits[-1], NEW_TOKENS)

    assert rel_err(reference_logits(reference, prompt), prompt_logits) <= TOLERANCE
    expected = reference_decode_logits(reference, prompt, generated[:-1])
    assert rel_err(expected, step_logits) <= TOLERANCE
    assert expected.argmax(-1).tolist() == generated


@pytest.mark.parametrize(
    "length, chunk_sizes",
    [(1000, (1, 7, 61, 3, 129, 33)), (300, (5, 128, 2)), (129, (127, 1, 1)), (260, (3,))],
)
def test_odd_prefill_chunks_give_the_same_greedy_continuation(tiny_model, reference_model, length, chunk_sizes):
    model, reference = tiny_model(0), reference_model(0)
    prompt = make_prompt(length, 0)
    whole_state, chunked_state = model.new_state(), model.new_state()
    whole = decode_greedy(model, whole_state, prefill(model, whole_state, prompt), NEW_TOKENS)

    chunk_logits, start, i = [], 0, 0
    while start < length:
        size = chunk_sizes[i % len(chunk_sizes)]
        chunk_logits.append(model([prompt[start : start + size]], [chunked_state], all_logits=True))
        start, i = start + size, i + 1
    chunk_logits = torch.cat(chunk_logits)
    chunked = decode_greedy(model, chunked_state, chunk_logits[-1], NEW_TOKENS)

    assert chunked == whole
    assert rel_err(reference_logits(reference, prompt), chunk_logits) <= TOLERANCE


def test_batched_sequences_match_separate_runs(tiny_model):
    model = tiny_model(1)
    prompts = [make_prompt(n, 1) for n in (300, 1, 129)]
    separate = []
    for prompt in prompts:
        state = model.new_state()
        separate.append(decode_with_logits(model, state, prefill(model, state, prompt), 16))

    states = [model.new_state() for _ in prompts]
    logits = model(prompts, states)
    tokens = [[int(row.argmax())] for row in logits]
    rows = [[row] for row in logits]
    for _ in range(15):
        logits = model([torch.tensor(t[-1:]) for t in tokens], states)
        for seq, row in enumerate(logits):
            tokens[seq].append(int(row.argmax()))
            rows[seq].append(row)

    for seq, (expected_tokens, expected_logits) in enumerate(separate):
        assert tokens[seq] == expected_tokens
        assert rel_err(expected_logits, torch.stack(rows[seq])) <= 1e-5


def test_checkpoint_saved_by_transformers_loads_unchanged(tmp_path):
    transformers = pytest.importorskip("transformers")
    raw = read_config_dict("tiny")
    config = transformers.DeepseekV4Config(**raw)
    torch.manual_seed(7)
    reference = transformers.DeepseekV4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, tensor in reference.state_dict().items():
            if name.endswith("tid2eid"):
                tensor.copy_(torch.rand(tensor.shape[0], config.n_routed_experts).argsort(-1)[:, : tensor.shape[1]])
            elif tensor.is_floating_point():
                tensor.copy_(torch.randn_like(tensor) * (0.5 if tensor.dim() == 1 else tensor.shape[-1] ** -0.5))
    reference.save_pretrained(tmp_path)

    model = load_model(tmp_path, dtype=torch.float32)
    prompt = make_prompt(200, 7)
    ours = model([prompt], [model.new_state()], all_logits=True)
    assert rel_err(reference_logits(reference, prompt), ours) <= TOLERANCE


def test_a_reshaped_config_matches_reference(tmp_path):
    """Other window, HCA ratio, top-k, head and group counts, layer order: nothing is hard-coded."""
    transformers = pytest.importorskip("transformers")
    raw = read_config_dict("tiny")
    raw.update(
        sliding_window=64,
        num_attention_heads=8,
        o_groups=4,
        index_topk=8,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32},
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"] * 2,
        mlp_layer_types=["moe", "hash_moe", "moe", "hash_moe", "moe", "moe"],
    )
    (tmp_path / "variant.json").write_text(json.dumps(raw))
    model_dir = write_random_model_dir(tmp_path / "variant.json", tmp_path / "model", 4, 512, torch.float32)
    model = load_model(model_dir, dtype=torch.float32)
    reference = transformers.DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    prompt = make_prompt(700, 4, vocab=512)
    state = model.new_state()
    prompt_logits = model([prompt], [state], all_logits=True)
    generated, step_logits = decode_with_logits(model, state, prompt_logits[-1], 32)
    assert rel_err(reference_logits(reference, prompt), prompt_logits) <= TOLERANCE
    expected = reference_decode_logits(reference, prompt, generated[:-1])
    assert rel_err(expected, step_logits) <= TOLERANCE
    assert expected.argmax(-1).tolist() == generated
