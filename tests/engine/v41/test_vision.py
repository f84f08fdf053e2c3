"""Our V4.1 vision tower and the prefill that merges it: the config, the released-format weights
(random init, loader), preprocessing (resize / gray pad, patch order), the span layout, batching,
errors, and `DeepseekV41.forward(embeds=...)` (rows replaced, image routing by id, chunking, batches).
NeMo equivalence is in test_vision_reference.py."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file

from engine.loading import load_model
from engine.models.v41.checkpoint import FP32, iter_vision_state_dict, vision_tensor_specs
from engine.models.v41.config import V41VisionConfig, load_v41_config
from engine.models.v41.random_init import random_rows, read_raw_config, write_random_v41_model_dir
from engine.models.v41.vision import VisionEncoder
from engine.models.v41.vision.aligner import fold_cells
from engine.models.v41.vision.preprocess import preprocess_image
from messages.images import ImageInput, VisionSizing, plan_image_grid
from tests.engine.references import TEST_VOCAB, rel_err

IMAGE_TOKEN = 1000  # inside the 1024-token test vocabulary (the release's 129264 is past it)
TIGHT = 1e-5
GRAY = float(torch.tensor((127 / 255 - 0.5) / 0.5).bfloat16())


def raw_config(vision_layers: int | None = None) -> dict:
    raw = read_raw_config("tiny-v41")
    raw["image_token_id"] = IMAGE_TOKEN
    if vision_layers is not None:
        raw["vision_config"]["num_hidden_layers"] = vision_layers
    return raw


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_v41_model_dir(raw_config(), tmp_path_factory.mktemp("vision") / "m", seed=0,
                                      vocab_size=TEST_VOCAB)


@pytest.fixture(scope="module")
def encoder(model_dir):
    return VisionEncoder.load(model_dir)


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir, dtype=torch.float32)


def png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(out, format="PNG")
    return out.getvalue()


def noise(width: int, height: int, seed: int) -> bytes:
    return png(np.random.default_rng(seed).integers(0, 256, (height, width, 3)))


def image_input(data: bytes, sizing: VisionSizing, start: int = 0) -> ImageInput:
    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
    return ImageInput(hashlib.sha256(data).digest(), data, width, height, plan_image_grid(width, height, sizing), start)


# ---- config


def test_config_parses_the_nested_vision_config():
    tiny = load_v41_config("tiny-v41").vision
    assert tiny == V41VisionConfig(num_layers=2, hidden_size=64, num_heads=4, intermediate_size=128,
                                   max_image_tokens=256, min_pixels=126 * 126)
    assert tiny.enabled and tiny.head_dim == 16
    assert tiny.sizing == VisionSizing(max_image_tokens=256, min_pixels=15876)
    assert not load_v41_config("tiny-v41-b").vision.enabled
    raw = read_raw_config("tiny-v41")
    del raw["vision_config"]
    assert load_v41_config(raw).vision == V41VisionConfig()  # missing: the release's tower, as in NeMo


@pytest.mark.parametrize("bad", [{"num_attention_heads": 3}, {"hidden_size": 72, "num_attention_heads": 12},
                                 {"max_image_tokens": 3}, {"max_wh_ratio": 0.5}, {"num_hidden_layers": -1}])
def test_bad_vision_configs_are_refused(bad):
    raw = read_raw_config("tiny-v41")
    raw["vision_config"].update(bad)
    with pytest.raises(ValueError):
        load_v41_config(raw)


# ---- weights


def test_random_init_adds_the_vision_tower_and_leaves_every_text_weight_as_it_was(tmp_path, model_dir):
    text_only = write_random_v41_model_dir(raw_config(vision_layers=0), tmp_path / "text", seed=0,
                                           vocab_size=TEST_VOCAB)
    assert json.loads((text_only / "config.json").read_text())["vision_config"]["num_hidden_layers"] == 0
    with safe_open(str(text_only / "model.safetensors"), "pt") as plain, \
            safe_open(str(model_dir / "model.safetensors"), "pt") as full:
        vision = set(full.keys()) - set(plain.keys())
        assert vision == set(vision_tensor_specs(load_v41_config(model_dir)))
        for key in plain.keys():
            assert torch.equal(plain.get_tensor(key).view(torch.uint8), full.get_tensor(key).view(torch.uint8)), key


def test_loaded_weights_are_the_seeded_draws_on_the_release_grid(model_dir, encoder):
    specs = vision_tensor_specs(load_v41_config(model_dir))
    state = encoder.state_dict()
    assert set(state) == set(specs)
    for name, spec in specs.items():
        drawn = random_rows(name, spec, 0, spec.shape[0], 0)
        expected = drawn if spec.format == FP32 else drawn.bfloat16().float()
        assert torch.equal(state[name], expected), name
        assert state[name].std() > 0.01, name  # nothing left at a constant
    assert specs["vision.blocks.1.norm2.weight"].format == FP32 and specs["aligner.w1.weight"].shape == (256, 576)


def test_bfloat16_load_keeps_the_norms_in_float32(model_dir):
    encoder = VisionEncoder.load(model_dir, dtype=torch.bfloat16)
    assert encoder.dtype == torch.bfloat16 and encoder.vision.norm.weight.dtype == torch.float32
    assert encoder.vision.blocks[0].attn.wqkv.weight.dtype == torch.bfloat16
    image = image_input(noise(60, 40, 1), encoder.sizing)
    (span,) = encoder.encode([encoder.preprocess(image)], [image.grid])
    assert span.dtype == torch.bfloat16 and span.shape == (image.grid.tokens, 256) and torch.isfinite(span).all()


def _dir_with(tmp_path, model_dir, tensors: dict, vision_layers: int | None = None):
    out = tmp_path / "d"
    out.mkdir()
    raw = json.loads((model_dir / "config.json").read_text())
    if vision_layers is not None:
        raw["vision_config"]["num_hidden_layers"] = vision_layers
    (out / "config.json").write_text(json.dumps(raw))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def _stored_vision(model_dir) -> dict:
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if k.startswith(("vision.", "aligner.", "image_"))}


@pytest.mark.parametrize("damage", ["no_vision", "missing", "unknown", "dtype"])
def test_the_vision_loader_refuses_what_the_config_does_not_describe(tmp_path, model_dir, damage):
    tensors = _stored_vision(model_dir)
    layers = None
    if damage == "no_vision":
        layers = 0
    elif damage == "missing":
        del tensors["aligner.w2.bias"]
    elif damage == "unknown":
        tensors["vision.blocks.2.norm1.weight"] = torch.ones(64)  # a third block of a 2-block config
    else:
        tensors["image_end"] = tensors["image_end"].half()  # float32 and bfloat16 load (cast); float16 does not
    out = _dir_with(tmp_path, model_dir, tensors, layers)
    error = {"no_vision": ValueError, "missing": KeyError, "unknown": KeyError, "dtype": ValueError}[damage]
    with pytest.raises(error):
        VisionEncoder.load(out)


def test_an_encoder_needs_a_vision_tower():
    with pytest.raises(ValueError, match="no vision encoder"):
        VisionEncoder(load_v41_config("tiny-v41-b"))


def test_the_text_loader_skips_the_vision_tower(model_dir, model):
    assert not any(name.startswith(("vision.", "aligner.", "image_")) for name in model.state_dict())
    assert len(dict(iter_vision_state_dict(model_dir))) == len(vision_tensor_specs(model.config))


# ---- preprocessing


TINY = VisionSizing(max_image_tokens=256, min_pixels=15876)


def solid(width: int, height: int, rgb) -> bytes:
    return png(np.broadcast_to(np.array(rgb), (height, width, 3)))


def pixels_of(patches: torch.Tensor, grid) -> torch.Tensor:
    """Patches back to the [3, H, W] picture."""
    p = patches.shape[-1]
    return patches.view(grid.vit_h, grid.vit_w, 3, p, p).permute(2, 0, 3, 1, 4).reshape(3, grid.height, grid.width)


def test_patches_are_row_major_and_normalized():
    """A 3x2-patch image whose patch (r, c) has value 10 * (r * 3 + c): patch i is (i // 3, i % 3)."""
    sizing = VisionSizing(min_pixels=100)
    picture = np.zeros((28, 42, 3))
    for r in range(2):
        for c in range(3):
            picture[14 * r : 14 * (r + 1), 14 * c : 14 * (c + 1)] = 10 * (r * 3 + c)
    image = image_input(png(picture), sizing)
    patches = preprocess_image(image, sizing)
    assert patches.shape == (6, 3, 14, 14) and patches.dtype == torch.float32
    for i in range(6):
        expected = float(torch.tensor((10 * i / 255 - 0.5) / 0.5).bfloat16())
        assert torch.all(patches[i] == expected), i


def test_a_small_image_is_scaled_up_and_centred_on_gray():
    image = image_input(solid(40, 60, (255, 0, 0)), TINY)   # 2400 px < 15876: scaled up to the grid
    grid = image.grid
    assert (grid.width, grid.height) == (112, 154) and grid.tokens == plan_image_grid(40, 60, TINY).tokens
    picture = pixels_of(preprocess_image(image, TINY), grid)
    # fit inside 112x154 keeping 2:3 -> 103x154, centred: gray columns at both sides, red in the middle
    assert torch.all(picture[:, :, :4] == GRAY) and torch.all(picture[:, :, -4:] == GRAY)
    assert torch.all(picture[:, :, 10:100] == torch.tensor([1.0, -1.0, -1.0])[:, None, None])


def test_an_image_of_whole_patches_is_unchanged():
    rng = np.random.default_rng(3)
    picture = rng.integers(0, 256, (126, 140, 3))
    image = image_input(png(picture), TINY)
    assert (image.grid.width, image.grid.height) == (140, 126)
    got = pixels_of(preprocess_image(image, TINY), image.grid)
    expected = ((torch.tensor(picture, dtype=torch.float32).permute(2, 0, 1) / 255 - 0.5) / 0.5).bfloat16().float()
    assert torch.equal(got, expected)


def test_an_image_wider_than_max_wh_ratio_is_stretched_without_gray():
    sizing = VisionSizing(max_image_tokens=384, min_pixels=147456, max_wh_ratio=8.0)
    image = image_input(solid(2000, 100, (0, 0, 255)), sizing)
    picture = pixels_of(preprocess_image(image, sizing), image.grid)
    assert torch.all(picture == torch.tensor([-1.0, -1.0, 1.0])[:, None, None])


@pytest.mark.parametrize("data", [b"", b"not an image", b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, noise(50, 50, 1)[:200]],
                         ids=["empty", "text", "header-only", "truncated"])
def test_undecodable_bytes_are_a_value_error(data):
    grid = plan_image_grid(50, 50, TINY)
    with pytest.raises(ValueError, match="undecodable"):
        preprocess_image(ImageInput(hashlib.sha256(data).digest(), data, 50, 50, grid), TINY)


def test_a_size_or_grid_the_encoder_would_not_plan_is_a_value_error():
    data = noise(50, 70, 2)
    good = image_input(data, TINY)
    with pytest.raises(ValueError, match="decodes to"):
        preprocess_image(ImageInput(good.digest, data, 70, 50, good.grid), TINY)
    with pytest.raises(ValueError, match="plan"):
        preprocess_image(ImageInput(good.digest, data, 50, 70, plan_image_grid(50, 70, VisionSizing())), TINY)


# ---- encoding


def test_fold_is_unfolds_order_with_padding():
    x = torch.randn(8 * 5, 7)
    folded = fold_cells(x, 8, 5, 3)
    grid = F.pad(x.view(8, 5, 7).permute(2, 0, 1), (0, 1, 0, 1))
    assert torch.equal(folded, F.unfold(grid[None], 3, stride=3)[0].T)


def test_the_span_is_start_rows_with_newlines_end(encoder):
    image = image_input(noise(300, 200, 4), encoder.sizing)
    grid = image.grid
    patches = encoder.preprocess(image)
    (span,) = encoder.encode([patches], [grid])
    assert span.shape == (grid.tokens, encoder.hidden_size) == (grid.llm_h * (grid.llm_w + 1) + 2, 256)
    vit_grid = [(grid.vit_h, grid.vit_w)]
    with torch.no_grad():
        cells = encoder.aligner(encoder.vision(patches, vit_grid), vit_grid)
    assert torch.equal(span[0], encoder.image_start) and torch.equal(span[-1], encoder.image_end)
    body = span[1:-1].view(grid.llm_h, grid.llm_w + 1, -1)
    assert all(torch.equal(row, encoder.image_newline) for row in body[:, -1])
    assert torch.equal(body[:, :-1].reshape(-1, 256), cells)


def test_a_batch_encodes_as_each_image_alone(encoder):
    sizes = [(300, 200), (50, 80), (1000, 40), (126, 126)]
    images = [image_input(noise(w, h, i), encoder.sizing) for i, (w, h) in enumerate(sizes)]
    patches = [encoder.preprocess(image) for image in images]
    together = encoder.encode(patches, [image.grid for image in images])
    for image, patch, span in zip(images, patches, together):
        (alone,) = encoder.encode([patch], [image.grid])
        assert span.shape == (image.grid.tokens, 256) and rel_err(alone, span) <= 1e-6
    assert encoder.encode([], []) == []


def test_encode_refuses_patches_that_do_not_fit_their_grids(encoder):
    image = image_input(noise(60, 60, 5), encoder.sizing)
    patches = encoder.preprocess(image)
    with pytest.raises(ValueError):
        encoder.encode([patches], [])
    with pytest.raises(ValueError):
        encoder.encode([patches[:-1]], [image.grid])
    with pytest.raises(ValueError):
        encoder.encode([patches], [plan_image_grid(60, 60, VisionSizing(downsample_ratio=2))])


# ---- the prefill with image rows


def _prompt(length: int, seed: int) -> list[int]:
    ids = torch.randint(3, TEST_VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    return [t if t != IMAGE_TOKEN else 5 for t in ids]


@pytest.fixture(scope="module")
def imaged(encoder):
    """A prompt of 20 text tokens, an image span, 15 text tokens: (ids, span start, span rows)."""
    image = image_input(noise(200, 150, 6), encoder.sizing)
    (rows,) = encoder.encode([encoder.preprocess(image)], [image.grid])
    ids = _prompt(20, 1) + [IMAGE_TOKEN] * image.grid.tokens + _prompt(15, 2)
    return ids, 20, rows


def _run(model, ids, embeds=None, **kwargs):
    return model([torch.tensor(ids)], [model.new_state()], all_logits=True, embeds=embeds, **kwargs)


@pytest.fixture
def no_rounding(monkeypatch):
    for module in ("engine.models.v41.attention", "engine.models.v41.indexer"):
        monkeypatch.setattr(f"{module}.round_cache", lambda values, point: values)


def test_embeds_replace_the_span_rows_and_route_image_tokens_by_id(model, imaged, no_rounding):
    ids, start, rows = imaged
    offsets = torch.arange(start, start + rows.shape[0])
    with_rows = _run(model, ids, [(offsets, rows)])
    plain = _run(model, ids)
    # causal: the text before the span is unchanged (up to the expert GEMMs' row counts)
    assert rel_err(plain[:start], with_rows[:start]) <= TIGHT and rel_err(plain, with_rows) > 1e-2
    mask = torch.tensor([t == IMAGE_TOKEN for t in ids])
    assert torch.equal(with_rows, _run(model, ids, [(offsets, rows)], image_masks=[mask]))
    # image_masks can only add image tokens: with rows in the step, the id rule holds whatever it says
    assert torch.equal(_run(model, ids, [(offsets, rows)], image_masks=[torch.zeros_like(mask)]), with_rows)
    assert torch.equal(_run(model, ids, [None]), plain)


def test_image_tokens_route_with_bias_vl(model, imaged):
    ids, start, rows = imaged
    offsets = torch.arange(start, start + rows.shape[0])
    with_rows = _run(model, ids, [(offsets, rows)])
    gates = [layer.ffn.gate for layer in model.layers]
    saved = [gate.bias_vl.clone() for gate in gates]
    try:
        for gate in gates:
            gate.bias_vl.copy_(gate.bias)
        text_biased = _run(model, ids, [(offsets, rows)])
    finally:
        for gate, bias_vl in zip(gates, saved):
            gate.bias_vl.copy_(bias_vl)
    assert rel_err(with_rows, text_biased) > 1e-3


def test_a_chunked_prefill_through_the_span_equals_one_shot(model, imaged, no_rounding):
    ids, start, rows = imaged
    whole = _run(model, ids, [(torch.arange(start, start + rows.shape[0]), rows)])
    state, pieces = model.new_state(), []
    for lo, hi in ((0, 25), (25, 40), (40, len(ids))):  # cuts inside the span
        span_lo, span_hi = max(lo, start), min(hi, start + rows.shape[0])
        entry = None
        if span_lo < span_hi:
            entry = (torch.arange(span_lo - lo, span_hi - lo), rows[span_lo - start : span_hi - start])
        pieces.append(model([torch.tensor(ids[lo:hi])], [state], all_logits=True, embeds=[entry]))
    assert rel_err(whole, torch.cat(pieces)) <= TIGHT


def test_a_batch_with_and_without_images_equals_each_alone(model, imaged, no_rounding):
    ids, start, rows = imaged
    text = _prompt(30, 3)
    entry = (torch.arange(start, start + rows.shape[0]), rows)
    batched = model([torch.tensor(text), torch.tensor(ids)], [model.new_state(), model.new_state()],
                    all_logits=True, embeds=[None, entry])
    assert rel_err(_run(model, text), batched[: len(text)]) <= TIGHT
    assert rel_err(_run(model, ids, [entry]), batched[len(text) :]) <= TIGHT


def test_image_ids_past_the_vocabulary_work_with_embeds(model, imaged, monkeypatch):
    """The release's image id (129264) in a 1024-token test model: the replaced rows never look it up."""
    ids, start, rows = imaged
    entry = [(torch.arange(start, start + rows.shape[0]), rows)]
    expected = _run(model, ids, entry)
    monkeypatch.setattr(model, "config", dataclasses.replace(model.config, image_token_id=129264))
    far = [129264 if t == IMAGE_TOKEN else t for t in ids]
    assert torch.equal(_run(model, far, entry), expected)


def test_bad_embeds_are_refused(model, imaged):
    ids, start, rows = imaged
    offsets = torch.arange(start, start + rows.shape[0])
    for embeds in ([(offsets + len(ids), rows)], [(offsets, rows[:-1])], [(offsets.int(), rows)],
                   [(offsets, rows[:, :-1])], [(offsets, rows), None]):
        with pytest.raises(ValueError):
            _run(model, ids, embeds)

