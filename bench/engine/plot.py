"""`epd bench engine --plot FILE`: tokens/s against batch size, one line per implementation and
context length, with the memory floor dashed (decode) and the compute floor (prefill).

Decode tokens/s = batch x 1000 / ms per step (each step makes one token per sequence); prefill
tokens/s is measured as such. Cells that did not run (OOM, out of time, HF on V4.1) have no point.
"""
from __future__ import annotations

from pathlib import Path

from bench.common.plot import draw_series, figure, save_png

IMPLS = ("ours", "torch", "hf", "floor")


def series(summary: list[dict]) -> tuple[dict, dict]:
    """(decode tokens/s by batch, prefill tokens/s by batch): "impl, context N" -> points."""
    out = {"decode": {}, "prefill": {}}
    for line in summary:
        for impl in IMPLS:
            value = line.get(impl)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                continue
            rate = line["batch"] * 1e3 / value if line["measure"] == "decode" else value
            out[line["measure"]].setdefault(f"{impl}, context {line['context']}", []).append((line["batch"], rate))
    return ({k: sorted(v) for k, v in out["decode"].items()}, {k: sorted(v) for k, v in out["prefill"].items()})


def draw(doc: dict):
    """The figure of one run's JSON document (its "summary" lines)."""
    decode, prefill = series(doc["summary"])
    title = (f"epd bench engine: {doc.get('config', '?')} on {doc.get('device_name', '?')} ({doc.get('device', '?')}), "
             f"{doc.get('dtype', '?')}" + (f", {doc['date']}" if "date" in doc else ""))
    fig, (left, right) = figure(2, title)
    styles = {label: "o--" if label.startswith("floor") else "o-" for label in (*decode, *prefill)}
    draw_series(left, decode, styles)
    left.set(xlabel="batch (sequences)", ylabel="tokens/s", title="decode", xscale="log", yscale="log")
    draw_series(right, prefill, styles)
    right.set(xlabel="batch (sequences)", ylabel="tokens/s", title="prefill", xscale="log", yscale="log")
    return fig


def write_plot(doc: dict, path: str | Path) -> Path:
    return save_png(draw(doc), path)
