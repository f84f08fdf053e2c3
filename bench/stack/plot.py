"""`epd bench stack --plot FILE`: time to first token under load, and tokens/s, stack against the
engine alone.

One result (one concurrency): each request's TTFT against its prompt length, and each round's
tokens/s. Several results (`--plot-from` JSON files of runs at different `--streams`): TTFT p50
and p99 and tokens/s against the number of concurrent streams.
"""
from __future__ import annotations

from pathlib import Path

from bench.common.plot import draw_series, figure, save_png

SIDES = ("engine", "stack")
STYLES = {"engine": "o", "stack": "x"}   # per-request points, not a line: requests are independent


def request_series(result: dict) -> tuple[dict, dict]:
    """(TTFT ms by prompt tokens, tokens/s by round), per side, from one run's result."""
    ttft = {side: sorted((r["prompt_tokens"], r["ttft_ms"]) for r in result["per_request"] if r["side"] == side)
            for side in SIDES}
    rate = {side: sorted((r["round"] + 1, r["tokens_per_s"]) for r in result["per_round"] if r["side"] == side)
            for side in SIDES}
    return ttft, rate


def concurrency_series(results: list[dict]) -> tuple[dict, dict]:
    """(TTFT p50 and p99 ms by streams, tokens/s by streams), per side, from runs at several --streams."""
    runs = sorted(results, key=lambda r: r["streams"])
    ttft = {f"{side} {q}": [(r["streams"], r[side][f"ttft_ms_{q}"]) for r in runs]
            for side in SIDES for q in ("p50", "p99")}
    rate = {side: [(r["streams"], r[side]["tokens_per_s"]) for r in runs] for side in SIDES}
    return ttft, rate


def draw(results: list[dict]):
    """The figure of one or several results."""
    first = results[0]
    dates = sorted({r["date"] for r in results if "date" in r})
    title = (f"epd bench stack: topology {first['topology']}, prompts {first['prompt_tokens_range'][0]}-"
             f"{first['prompt_tokens_range'][1]} tokens, {first['max_tokens']} out"
             + (f", {dates[0]}" if len(dates) == 1 else f", {dates[0]} to {dates[-1]}" if dates else ""))
    fig, (left, right) = figure(2, title)
    if len(results) == 1:
        ttft, rate = request_series(first)
        draw_series(left, ttft, STYLES)
        left.set(xlabel="prompt tokens", ylabel="TTFT ms",
                 title=f"TTFT per request, {first['streams']} concurrent streams")
        draw_series(right, rate, integer_x=True)
        right.set(xlabel="round", ylabel="output tokens/s", title="tokens/s per round")
    else:
        ttft, rate = concurrency_series(results)
        draw_series(left, ttft, {k: "o-" if k.endswith("p50") else "s--" for k in ttft}, integer_x=True)
        left.set(xlabel="concurrent streams", ylabel="TTFT ms", title="TTFT under load")
        draw_series(right, rate, integer_x=True)
        right.set(xlabel="concurrent streams", ylabel="output tokens/s", title="tokens/s under load")
    return fig


def write_plot(results: list[dict], path: str | Path) -> Path:
    return save_png(draw(results), path)
