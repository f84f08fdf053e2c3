"""`epd bench engine --plot`: decode and prefill tokens/s against batch, per implementation and
context, from a run's summary lines."""
from __future__ import annotations

from bench.engine.plot import draw, write_plot
from tests.helpers.test_helper_plot import lines_of, png_size


def summary_line(measure: str, batch: int, context: int, ours, hf, floor) -> dict:
    return {"measure": measure, "batch": batch, "context": context, "ours": ours, "hf": hf, "floor": floor}


SUMMARY = [summary_line("decode", 1, 256, 10.0, 20.0, 2.0),       # ms per step
           summary_line("decode", 4, 256, 12.5, "OOM", 2.5),
           summary_line("prefill", 1, 256, 900.0, 450.0, 5000.0),  # tokens/s
           summary_line("prefill", 4, 256, 1500.0, "OOM", 5000.0)]


def test_decode_is_batch_over_step_time_and_prefill_is_as_measured_cells_that_did_not_run_are_left_out(tmp_path):
    decode, prefill = lines_of(draw({"config": "tiny", "device": "cpu", "dtype": "bfloat16", "summary": SUMMARY}))
    assert decode == {"ours, context 256": [(1.0, 100.0), (4.0, 320.0)], "hf, context 256": [(1.0, 50.0)],
                      "floor, context 256": [(1.0, 500.0), (4.0, 1600.0)]}
    assert prefill == {"ours, context 256": [(1.0, 900.0), (4.0, 1500.0)], "hf, context 256": [(1.0, 450.0)],
                       "floor, context 256": [(1.0, 5000.0), (4.0, 5000.0)]}
    assert png_size(write_plot({"summary": SUMMARY}, tmp_path / "engine.png"))[0] > 0
