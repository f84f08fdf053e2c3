"""Shared fixtures: seeded random tiny models (vocab 1024, fp32), ours and the transformers reference."""

from __future__ import annotations

import pytest
import torch

from engine.models.v4 import load_model
from engine.models.v4.random_init import write_random_model_dir
from tests.engine.references import TEST_VOCAB, make_prompt


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """seed -> a random tiny model directory (cached per session)."""
    dirs = {}

    def get(seed: int):
        if seed not in dirs:
            dirs[seed] = write_random_model_dir(
                "tiny", tmp_path_factory.mktemp(f"tiny{seed}"), seed=seed, vocab_size=TEST_VOCAB, dtype=torch.float32
            )
        return dirs[seed]

    return get


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    models = {}

    def get(seed: int):
        if seed not in models:
            models[seed] = load_model(tiny_dir(seed), dtype=torch.float32)
        return models[seed]

    return get


@pytest.fixture(scope="session")
def reference_model(tiny_dir):
    transformers = pytest.importorskip("transformers")
    models = {}

    def get(seed: int):
        if seed not in models:
            model = transformers.DeepseekV4ForCausalLM.from_pretrained(tiny_dir(seed), dtype=torch.float32)
            models[seed] = model.eval()
        return models[seed]

    return get


@pytest.fixture(scope="session", autouse=True)
def single_torch_thread():
    """One intra-op thread: on a small, shared CI machine the tiny model's many small ops run
    faster and far more predictably than with spinning OpenMP workers."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def make_engine(tiny_dir):
    """EngineCore on the seed-0 tiny model (fp32); keyword arguments override EngineConfig."""
    from engine.engine_core import EngineConfig, EngineCore

    def make(**overrides):
        return EngineCore(EngineConfig(model_dir=str(tiny_dir(0)), dtype="float32", **overrides))

    return make


@pytest.fixture(scope="session")
def greedy_alone(tiny_model):
    """prompt length -> the 64-token greedy continuation of make_prompt(length, 0), computed alone on
    the contiguous-state model (the oracle every engine path must reproduce). Cached per session."""
    from engine.models.v4.generate import greedy_generate

    cache = {}

    def get(length: int, new_tokens: int = 64) -> list[int]:
        if (length, new_tokens) not in cache:
            cache[length, new_tokens] = greedy_generate(tiny_model(0), make_prompt(length, 0), new_tokens)
        return cache[length, new_tokens]

    return get


@pytest.fixture
def per_sequence_decode():
    """model -> the same model with decode steps of paged states on the per-sequence path (the
    reference for the batched one) until the test ends."""
    touched = []

    def use(model):
        touched.append((model, model.batched_decode))
        model.batched_decode = False
        return model

    yield use
    for model, previous in reversed(touched):
        model.batched_decode = previous
