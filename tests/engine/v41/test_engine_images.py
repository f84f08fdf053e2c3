"""Images in the engine: a request's span embeddings reach the model at the span's positions, the
block hashes name the image, and a step never computes an image token without its embeddings."""

from __future__ import annotations

import pytest
import torch

from engine.engine_core import EngineConfig, EngineCore, EngineRequest
from engine.loading import load_model
from engine.models.v41.random_init import read_raw_config
from engine.models.v41.random_init import write_random_v41_model_dir
from messages.common import FinishReason
from messages.images import ImageGrid, ImageInput
from tests.engine.references import TEST_VOCAB, greedy_params, make_prompt, run_engine

IMAGE_TOKEN = TEST_VOCAB - 4          # the test vocabulary is small: the image token moves inside it
GRID = ImageGrid(126, 126, 9, 9, 3, 3)  # 14 tokens
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    raw = read_raw_config("tiny-v41")
    raw["image_token_id"] = IMAGE_TOKEN
    return write_random_v41_model_dir(raw, tmp_path_factory.mktemp("v41img") / "m", seed=0, vocab_size=TEST_VOCAB)


@pytest.fixture(autouse=True)
def no_cache_rounding(monkeypatch):
    """Paged and contiguous runs split matmuls differently; a last-bit difference can flip an fp4/fp8
    rounding (test_engine_v41.py). What is checked here is which rows the model sees."""
    for module in ("engine.models.v41.attention", "engine.models.v41.indexer"):
        monkeypatch.setattr(f"{module}.round_cache", lambda values, point: values)


def prompt_with_image(length: int, start: int) -> list[int]:
    ids = [t if t != IMAGE_TOKEN else 5 for t in make_prompt(length, 0).tolist()]
    ids[start : start + GRID.tokens] = [IMAGE_TOKEN] * GRID.tokens
    return ids


def image(digest: bytes, start: int) -> ImageInput:
    return ImageInput(digest=digest, data=b"", width=100, height=100, grid=GRID, start=start)


def rows(seed: int, hidden: int = 256) -> torch.Tensor:
    return torch.randn(GRID.tokens, hidden, generator=torch.Generator().manual_seed(seed))


def engine(model_dir, **overrides) -> EngineCore:
    return EngineCore(EngineConfig(model_dir=str(model_dir), dtype="float32", num_pages=64, max_num_seqs=4,
                                   **overrides))


def oracle(model, prompt: list[int], start: int, span: torch.Tensor) -> list[int]:
    """Greedy on the contiguous state, the span's rows given to the model directly."""
    state = model.new_state()
    offsets = torch.arange(start, start + GRID.tokens)
    logits = model([torch.tensor(prompt)], [state], embeds=[(offsets, span)])
    out = []
    for _ in range(NEW_TOKENS):
        out.append(int(logits[0].argmax()))
        logits = model([torch.tensor(out[-1:])], [state])
    return out


def test_span_rows_reach_the_model_through_chunked_prefill(image_dir):
    prompt, start, span = prompt_with_image(300, 90), 90, rows(1)
    expected = oracle(load_model(image_dir, dtype=torch.float32), prompt, start, span)
    core = engine(image_dir, max_batched_tokens=96, enable_prefix_cache=False)   # the span crosses a chunk edge
    core.add_request(EngineRequest("a", prompt, greedy_params(NEW_TOKENS), images=[image(b"a" * 32, start)],
                                   image_embeds=[span]))
    assert run_engine(core)["a"].tokens == expected
    other = oracle(load_model(image_dir, dtype=torch.float32), prompt, start, rows(2))
    assert other != expected   # the rows matter: another image answers otherwise


def test_a_step_never_computes_an_image_without_its_rows(image_dir):
    core = engine(image_dir)
    core.add_request(EngineRequest("a", prompt_with_image(200, 20), greedy_params(NEW_TOKENS),
                                   images=[image(b"a" * 32, 20)], image_embeds=[None]))
    result = run_engine(core)["a"]
    assert result.finish_reason == FinishReason.ERROR and result.tokens == []
    assert not core.has_unfinished() and core.stats().kv_usage == 0


def test_bad_spans_are_refused(image_dir):
    core = engine(image_dir)
    prompt = prompt_with_image(200, 20)
    with pytest.raises(ValueError, match="not a run of image tokens"):
        core.add_request(EngineRequest("a", prompt, greedy_params(2), images=[image(b"a" * 32, 21)]))
    with pytest.raises(ValueError, match="embeddings have shape"):
        core.add_request(EngineRequest("b", prompt, greedy_params(2), images=[image(b"a" * 32, 20)],
                                       image_embeds=[torch.zeros(3, 256)]))


def test_the_prefix_cache_tells_images_apart(image_dir):
    """The same image again hits the blocks after it; another image at the same place does not."""
    core = engine(image_dir)
    prompt, start = prompt_with_image(520, 200), 200   # the image sits in block 1 (128..256)

    def run(rid: str, digest: bytes) -> int:
        core.add_request(EngineRequest(rid, prompt, greedy_params(2), images=[image(digest, start)],
                                       image_embeds=[rows(digest[0])]))
        outs = run_engine(core)
        assert outs[rid].finish_reason == FinishReason.LENGTH
        return outs[rid].last.num_cached_tokens

    run("first", b"a" * 32)
    assert run("same", b"a" * 32) >= 256
    assert run("other", b"b" * 32) <= 128


def test_a_replayed_tail_needs_the_rows_of_its_images(image_dir):
    """Without a saved window a hit replays its last block (V4.1 bounded replay): an image in that
    block must come with its rows again, one before it need not (services/workers/images.py)."""
    core = engine(image_dir, swa_cache_bytes=0)   # no window states: every hit replays

    def run(rid: str, prompt, start: int, span) -> object:
        core.add_request(EngineRequest(rid, prompt, greedy_params(2), images=[image(b"a" * 32, start)],
                                       image_embeds=[span]))
        return run_engine(core)[rid]

    late, early = prompt_with_image(520, 400), prompt_with_image(520, 150)
    for prompt, start in ((late, 400), (early, 150)):
        assert run(f"warm{start}", prompt, start, rows(1)).finish_reason == FinishReason.LENGTH
    missing = run("late-without", late, 400, None)   # the hit (512) replays from 384: the image is in it
    assert missing.finish_reason == FinishReason.ERROR
    given = run("late-with", late, 400, rows(1))
    assert given.finish_reason == FinishReason.LENGTH and given.last.num_cached_tokens >= 384
    skipped = run("early-without", early, 150, None)   # the image ends before the replayed block
    assert skipped.finish_reason == FinishReason.LENGTH and skipped.last.num_cached_tokens >= 384
