"""`epd bench engine` on a V4.1 config (CPU, tiny-v41's first 3 layers: SWA-only, Engram, a ratio-2 KV
source): weights drawn in the released formats go through our loader; HF is marked n/a; the two decode
floors (today's dequantized bytes, the release's quantized bytes) are counted right. No timing asserts."""
from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import pytest
import torch

from engine.models.v4.config import read_config_dict
from engine.quant.mxfp4 import dequantize_mxfp4, unpack_nibbles
from engine.models.v41.checkpoint import FP8, FP8_ROWS, MXFP4, released_tensor_specs
from engine.models.v41.config import load_v41_config
import bench
from bench.engine.floor_v41 import floor_row_v41, kv_bytes, released_kv_bytes
from bench.engine.plan import Cell
from bench.engine.weights_v41 import draw_stored, draw_v41_model, v41_weight_bytes, with_layers, write_v41_model_dir

LAYERS = 3
RATES = {"copy_bytes_per_s": 1e12, "matmul_flops_per_s": 1e14}


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Many small ops run faster and steadier on one thread of a small, shared machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def drawn():
    raw = with_layers(read_config_dict("tiny-v41"), LAYERS)
    config = load_v41_config(raw)
    with tempfile.TemporaryDirectory() as tmp:
        model = draw_v41_model(write_v41_model_dir(raw, config, Path(tmp) / "m"), torch.device("cpu"),
                               torch.bfloat16, seed=3)
        yield config, model


def run_bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="epd")
    bench.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "engine", *argv])
    return args.func(args)


def test_stored_tensors_are_the_release_formats_seeded_and_never_zero(drawn):
    config, _ = drawn
    specs = released_tensor_specs(config)
    seen = set()
    for name, spec in specs.items():
        if spec.format in seen or not spec.quantized:
            continue
        seen.add(spec.format)
        stored = draw_stored(name, spec, "cpu", seed=3)
        assert [(tuple(t.shape), t.dtype) for t in stored] == [(s, d) for _, s, d in spec.stored(name)], name
        exponents = stored[1].view(torch.uint8).int()
        assert 1 <= exponents.min() and exponents.max() <= 254 and exponents.max() - exponents.min() <= 2, name
        if spec.format == MXFP4:
            codes = unpack_nibbles(stored[0])
            assert not ((codes == 0) | (codes == 8)).any(), "an MXFP4 zero code"
        else:
            assert (stored[0].float() != 0).all() and stored[0].float().isfinite().all(), name
        again = draw_stored(name, spec, "cpu", seed=3)
        other = draw_stored(name, spec, "cpu", seed=4)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(stored, again))
        assert not torch.equal(stored[0].view(torch.uint8), other[0].view(torch.uint8))
    assert seen == {FP8, MXFP4, FP8_ROWS}


def test_the_model_holds_the_dequantized_draws(drawn):
    config, model = drawn
    specs = released_tensor_specs(config)
    name = "layers.2.ffn.experts.5.w2.weight"
    packed, scale = draw_stored(name, specs[name], "cpu", seed=3)
    assert torch.equal(model.layers[2].ffn.experts[5].w2.weight, dequantize_mxfp4(packed, scale, torch.bfloat16))
    w = model.layers[2].ffn.experts[5].w1.weight.float()
    assert 0.25 < w.std().item() * math.sqrt(config.hidden_size) / 4.0 < 4  # near the std random_rows gives
    table = model.layers[1].engram.table
    assert table.quantized and table.num_rows == config.engram_num_embeddings[0]
    assert model.engram_hash is not None and model.head.weight.dtype == torch.float32


def test_weight_bytes_today_and_as_released(drawn):
    config, model = drawn
    weights = v41_weight_bytes(model)
    h, inter = config.hidden_size, config.moe_intermediate_size
    assert weights["expert"] == 3 * h * inter * 2                      # bf16 after dequantization
    assert weights["released"]["expert"] == 3 * (h * inter // 2 + h * inter // 32)  # MXFP4 + e8m0 per 32
    assert weights["released"]["dense"] < weights["dense"]
    assert weights["released"]["table"] == weights["engram_table_host_bytes"] > 0
    assert weights["moe_layers"] == LAYERS and weights["active_params_per_token"] > 0


def test_floors_count_weights_experts_and_kv(drawn):
    config, model = drawn
    weights = v41_weight_bytes(model)
    floors = {(b, c): floor_row_v41(config, weights, RATES, Cell(b, c)) for b in (1, 8) for c in (256, 512)}
    one = floors[1, 256]
    assert one["experts_touched_per_layer"] == config.experts_per_token
    # tiny-v41's layer 2 is the only KV source (ratio 2): 32 latent + 32 index-key channels per entry today
    per_token, swa = kv_bytes(config, 2)
    assert per_token == (config.head_dim + config.index_head_dim) * 2 / 2
    assert swa == LAYERS * config.sliding_window * config.head_dim * 2
    # released: nvfp4 entry (32 + 4 B) + mxfp4 index key (16 + 1 B) per 2 tokens; fp8 + e8m0 windows
    assert released_kv_bytes(config) == ((32 + 4 + 16 + 1) / 2, LAYERS * config.sliding_window * (64 + 2))
    expected = (weights["dense"] + LAYERS * config.experts_per_token * weights["expert"]
                + 256 * per_token + swa + config.hidden_size * 2)
    assert one["decode_bytes"] == int(expected)
    assert one["decode_floor_ms"] == pytest.approx(1e3 * expected / RATES["copy_bytes_per_s"])
    for f in floors.values():
        assert f["decode_bytes_released"] < f["decode_bytes"] and f["kv_bytes_released"] < f["kv_bytes"]
    assert floors[8, 256]["decode_bytes"] > floors[1, 512]["decode_bytes"] > one["decode_bytes"]
    assert floors[8, 256]["experts_touched_per_layer"] < 8 * config.experts_per_token  # shared by tokens
    assert config.engram_layer_ids == (1, 2)  # each reads 3 n-gram sizes x 2 heads of 64-wide FP8 rows + scales
    assert one["engram_host_bytes"] == 2 * 3 * 2 * (64 + 2)
    assert one["prefill_flops"] == 2 * (256 * weights["active_params_per_token"] + config.vocab_size * config.hidden_size)


@pytest.mark.timeout(180)
def test_engine_bench_v41_cpu_runs_ours_against_both_floors(tmp_path, capsys):
    out = tmp_path / "engine.json"
    assert run_bench(["--config", "tiny-v41", "--layers", str(LAYERS), "--device", "cpu", "--quick",
                      "--batches", "1,2", "--contexts", "160", "--steps", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["complete"] is True and doc["arch"] == "v4.1" and doc["layers"] == LAYERS
    assert doc["hf"].startswith("n/a") and doc["ours_engine"]["cuda_graphs"] is False
    sanity = doc["sanity"]
    assert sanity["logits_finite"] and len(sanity["distinct_experts_per_layer"]) == LAYERS
    assert all(1 <= n <= 8 for n in sanity["distinct_experts_per_layer"])  # tiny-v41 routes 2 of 8
    rows = {(r["impl"], r["batch"]): r for r in doc["rows"]}
    for b in (1, 2):
        assert rows["ours", b]["status"] == "ok" and rows["ours", b]["step_ms"] > 0
        assert rows["hf", b]["status"].startswith("n/a: transformers has no DeepSeek V4.1")
    decode = [s for s in doc["summary"] if s["measure"] == "decode"]
    assert len(decode) == 2 and all(s["hf"] == "n/a" and s["vs_hf"] is None for s in decode)
    assert all(0 < s["floor_released"] < s["floor"] and s["x_floor_released"] > s["x_floor"] > 0 for s in decode)
    assert all(s["x_floor"] > 0 for s in doc["summary"] if s["measure"] == "prefill")
    printed = capsys.readouterr().out
    header = next(line for line in printed[printed.rindex("epd bench engine:"):].splitlines()
                  if line.startswith("measure"))
    assert "floor q" in header and "x floor q" in header


def test_layers_is_for_v41_configs_only(capsys):
    assert run_bench(["--config", "tiny", "--device", "cpu", "--layers", "2", "--quick"]) == 2
    assert "V4.1 configs only" in capsys.readouterr().err
