"""`epd bench stack --plot`: the figure shows the recorded numbers, one run or several at different
concurrency, and lands as a PNG."""
from __future__ import annotations

import argparse
import json

import bench
from bench.stack.plot import draw, write_plot
from tests.helpers.test_helper_plot import lines_of, png_size


def recorded(streams: int, engine_p50: float, stack_p50: float) -> dict:
    """A stack result as `--json` records it, cut to what the plot reads."""
    side = lambda p50, rate: {"ttft_ms_p50": p50, "ttft_ms_p99": 2 * p50, "tokens_per_s": rate}   # noqa: E731
    return {"topology": "default", "prompt_tokens_range": [20, 160], "max_tokens": 8, "streams": streams,
            "date": "2026-12-02T07:30:00+00:00",
            "per_request": [{"side": "engine", "round": 0, "stream": 0, "prompt_tokens": 90, "ttft_ms": 40.0},
                            {"side": "engine", "round": 0, "stream": 1, "prompt_tokens": 30, "ttft_ms": 25.0},
                            {"side": "stack", "round": 0, "stream": 0, "prompt_tokens": 90, "ttft_ms": 70.0},
                            {"side": "stack", "round": 0, "stream": 1, "prompt_tokens": 30, "ttft_ms": 55.5}],
            "per_round": [{"side": "engine", "round": 0, "tokens_per_s": 300.0},
                          {"side": "stack", "round": 0, "tokens_per_s": 240.0}],
            "engine": side(engine_p50, 100.0 * streams), "stack": side(stack_p50, 90.0 * streams)}


def test_one_run_plots_each_requests_ttft_by_prompt_length_and_each_rounds_tokens_per_s(tmp_path):
    result = recorded(2, 30.0, 60.0)
    ttft, rate = lines_of(draw([result]))
    assert ttft == {"engine": [(30.0, 25.0), (90.0, 40.0)], "stack": [(30.0, 55.5), (90.0, 70.0)]}
    assert rate == {"engine": [(1.0, 300.0)], "stack": [(1.0, 240.0)]}
    assert png_size(write_plot([result], tmp_path / "one.png"))[0] > 0


def test_runs_at_several_concurrencies_plot_ttft_and_tokens_per_s_against_streams(tmp_path):
    runs = [recorded(8, 50.0, 90.0), recorded(1, 20.0, 35.0), recorded(4, 30.0, 60.0)]   # any order
    ttft, rate = lines_of(draw(runs))
    assert ttft["engine p50"] == [(1.0, 20.0), (4.0, 30.0), (8.0, 50.0)]
    assert ttft["stack p99"] == [(1.0, 70.0), (4.0, 120.0), (8.0, 180.0)]
    assert set(ttft) == {"engine p50", "engine p99", "stack p50", "stack p99"}
    assert rate == {"engine": [(1.0, 100.0), (4.0, 400.0), (8.0, 800.0)],
                    "stack": [(1.0, 90.0), (4.0, 360.0), (8.0, 720.0)]}


def test_plot_from_recorded_json_writes_the_png_without_starting_anything(tmp_path, capsys):
    paths = []
    for streams in (1, 4):
        paths.append(tmp_path / f"stack-{streams}.json")
        paths[-1].write_text(json.dumps(recorded(streams, 10.0 * streams, 20.0 * streams)))
    out = tmp_path / "plots" / "ttft.png"
    parser = argparse.ArgumentParser(prog="epd")
    bench.register(parser.add_subparsers(dest="command", required=True))
    argv = ["bench", "stack", "--plot-from", *map(str, paths), "--plot", str(out), "--model-dir", "/nonexistent"]
    args = parser.parse_args(argv)
    assert args.func(args) == 0, capsys.readouterr().err
    assert png_size(out) and str(out) in capsys.readouterr().out
    args = parser.parse_args(["bench", "stack", "--plot-from", str(paths[0])])
    assert args.func(args) == 2 and "--plot-from needs --plot FILE" in capsys.readouterr().err
