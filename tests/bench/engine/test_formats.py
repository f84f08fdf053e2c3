"""`epd bench engine --weights released --kernels compare` on the CPU: the torch path and then the
packed model run on the same weights; floors come from the bytes held after packing. On the CPU no
kernel runs (the packed weights are dequantized per call), so the two paths agree exactly."""
from __future__ import annotations

import json

import pytest

from tests.bench.engine.test_engine_bench import run_bench

pytest.importorskip("transformers")


@pytest.mark.timeout(300)
def test_released_weights_compare_torch_path_and_packed_model(tmp_path, capsys):
    out = tmp_path / "engine.json"
    assert run_bench(["--config", "tiny", "--device", "cpu", "--quick", "--batches", "1", "--contexts", "128",
                      "--steps", "1", "--skip-hf", "--dtype", "float32", "--weights", "released",
                      "--kernels", "compare", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["complete"] is True
    assert doc["rounded"] == doc["packed"] and doc["packed"]["experts"] == "mxfp4"
    assert doc["packed"]["expert_layers"] == 6 and doc["packed"]["linear_layers"] > 0
    # the packed model holds MXFP4 experts: about 4.25 bits of 32 per weight
    assert doc["weights_held"]["expert"] < doc["weights"]["expert"] / 7
    assert doc["weights_held"]["dense"] < doc["weights"]["dense"]
    floor = doc["floors"][0]
    assert floor["decode_bytes"] < doc["weights"]["dense"]  # from the held bytes, not the fp32 ones
    agreement = doc["kernel_agreement"]
    assert agreement["argmax_equal"] and agreement["within_bf16"] and agreement["max_rel_err"] < 1e-5
    rows = {r["impl"]: r for r in doc["rows"]}
    assert rows["torch"]["status"] == "ok" and rows["ours"]["status"] == "ok"
    decode = next(s for s in doc["summary"] if s["measure"] == "decode")
    assert decode["torch"] == rows["torch"]["step_ms"] and decode["vs_torch"] > 0
    printed = capsys.readouterr().out
    header = next(line for line in printed[printed.rindex("epd bench engine:"):].splitlines()
                  if line.startswith("measure"))
    assert "vs torch" in header


def test_weights_and_kernels_options_are_checked(capsys):
    with pytest.raises(SystemExit):
        run_bench(["--weights", "int4"])
    assert "invalid choice" in capsys.readouterr().err
