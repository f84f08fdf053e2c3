"""What `epd bench engine` prints and summarizes: the per-cell log line, the measurements table, the
notes, and the last table (ours beside HF and the floor, `vs HF` and `x floor`) with its JSON summary.
"""
from __future__ import annotations

from bench.engine.plan import Cell, Run
from bench.common.table import print_table


def summarize(rows: list[dict], floors: list[dict], cells: list[Cell], plan: dict) -> list[dict]:
    """One line per (measure, batch, context): ours, HF, floor and the ratios."""
    by = {(r["impl"], r["batch"], r["context"]): r for r in rows}
    floor = {(f["batch"], f["context"]): f for f in floors}
    out = []
    for kind in ("decode", "prefill"):
        for cell in cells:
            ours, hf = by.get(("ours", cell.batch, cell.context)), by.get(("hf", cell.batch, cell.context))
            torch_path = by.get(("torch", cell.batch, cell.context))
            f = floor[cell.batch, cell.context]
            line = {"measure": kind, "batch": cell.batch, "context": cell.context}
            if kind == "decode":
                line.update(unit="ms/step", ours=_value(ours, "step_ms"), hf=_value(hf, "step_ms"),
                            floor=round(f["decode_floor_ms"], 3))
                line["vs_hf"] = _ratio(line["hf"], line["ours"])
                line["x_floor"] = _ratio(line["ours"], line["floor"])
                if torch_path is not None:
                    line["torch"] = _value(torch_path, "step_ms")
                    line["vs_torch"] = _ratio(line["torch"], line["ours"])
                if "decode_floor_ms_released" in f:  # V4.1: the floor of the release's formats too
                    line["floor_released"] = round(f["decode_floor_ms_released"], 3)
                    line["x_floor_released"] = _ratio(line["ours"], line["floor_released"])
            else:
                line.update(unit="tokens/s", ours=_value(ours, "prefill_tokens_per_s"),
                            hf=_value(hf, "prefill_tokens_per_s"), floor=round(f["prefill_floor_tokens_per_s"], 1))
                line["vs_hf"] = _ratio(line["ours"], line["hf"])
                line["x_floor"] = _ratio(line["floor"], line["ours"])
                if torch_path is not None:
                    line["torch"] = _value(torch_path, "prefill_tokens_per_s")
                    line["vs_torch"] = _ratio(line["ours"], line["torch"])
            out.append(line)
    return out


def _value(row: dict | None, key: str):
    if row is None:
        return "not run"
    status = row.get("status", "?")
    if status.startswith("n/a"):   # HF on a V4.1 config: there is no HF model to run
        return "n/a"
    if status != "ok":   # the short form; the row in the JSON (and the table above) has the whole reason
        return next((short for prefix, short in (("OOM", "OOM"), ("not run (RAM)", "not run (RAM)"),
                                                  ("skipped", "skipped (time)"),
                                                  ("cut", "cut (time)"), ("pool", "pool too small"))
                     if status.startswith(prefix)), status[:20])
    return row[key]


def _ratio(a, b):
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b:
        return round(a / b, 2)
    return None


def print_report(bench: Run, summary: list[dict]) -> None:
    doc = bench.doc
    rows = [r for r in bench.rows]
    detail = [[r["impl"], r["batch"], r["context"], r.get("status", "")[:70],
               _fmt(r.get("prefill_tokens_per_s")), _fmt(r.get("step_ms")), _fmt(r.get("step_ms_median")),
               _fmt(r.get("peak_gib"))] for r in rows]
    print_table(["impl", "batch", "context", "status", "prefill tok/s", "step ms", "median ms", "peak GiB"],
                detail, title="\nmeasurements (step = one decode token for every sequence of the batch)")
    agreement = doc.get("agreement")
    rates = doc["rates"]
    notes = [f"weights: {doc['weights']['total'] / 2**30:.1f} GiB random {doc['dtype']} drawn on {doc['device']} "
             f"(seed {doc['seed']}); dense {doc['weights']['dense'] / 1e9:.2f} GB + "
             f"{doc['weights']['expert'] / 1e6:.1f} MB per touched expert per layer",
             f"copy rate {rates['copy_bytes_per_s'] / 1e12:.2f} TB/s (read+write), matmul "
             f"{rates['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s"]
    released = doc["weights"].get("released")
    if released:  # V4.1
        notes.append(f"released formats: {released['total'] / 2**30:.1f} GiB (dense {released['dense'] / 1e9:.2f} GB + "
                     f"{released['expert'] / 1e6:.1f} MB per touched expert per layer); Engram tables "
                     f"{doc['weights']['engram_table_host_bytes'] / 2**30:.2f} GiB FP8 in host memory "
                     f"(pinned: {doc['weights']['engram_tables_pinned']})")
    if doc.get("hf"):
        notes.append(f"HF: {doc['hf']}")
    if "hf_weights" in doc:
        notes.append(f"HF shares {doc['hf_weights']['shared_bytes'] / 2**30:.2f} GiB of our tensors; "
                     f"agreement on one prompt: {agreement}")
    print("\n" + "\n".join(notes), flush=True)
    table = [[f"{s['measure']} {s['unit']}", s["batch"], s["context"], _fmt(s["ours"]), _fmt(s["hf"]),
              _fmt(s["floor"]), _x(s["vs_hf"]), _x(s["x_floor"])] for s in summary]
    headers = ["measure", "batch", "context", "ours", "HF", "floor", "vs HF", "x floor"]
    if any("vs_torch" in s for s in summary):  # --kernels compare: our torch path, same weights
        headers += ["torch", "vs torch"]
        table = [row + [_fmt(s.get("torch")), _x(s.get("vs_torch"))] for row, s in zip(table, summary)]
        notes_k = doc.get("kernel_agreement")
        if notes_k:
            print(f"kernels vs torch path, last-token logits: {notes_k}", flush=True)
    if doc.get("packed"):
        print(f"packed for the kernel path: {doc['packed']}; floors from the bytes held after packing", flush=True)
    if released:  # V4.1: the decode floor of the release's formats and ours against it
        headers += ["floor q", "x floor q"]
        table = [row + [_fmt(s.get("floor_released")), _x(s.get("x_floor_released"))] for row, s in zip(table, summary)]
    title = (f"\nepd bench engine: {doc['config']} on {doc['device_name']}, {doc['dtype']}, "
             f"torch {doc['torch']}, transformers {doc['transformers']}; "
             "vs HF = times faster than HF; x floor = times the floor (decode: bytes / copy rate; "
             "prefill: active-weight FLOPs / matmul rate)")
    if released:
        title += ("; floor = weights as our engine holds them today (dequantized), floor q = the release's "
                  "quantized bytes (FP8/MXFP4 + scales, quantized caches)")
    print_table(headers, table, title=title)


def _fmt(value):
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:,.3g}" if abs(value) < 10 else f"{value:,.2f}"
    return value


def _x(value):
    return "" if value is None else f"{value:.2f}x"


def describe(row: dict) -> str:
    head = f"{row['impl']:4s} b={row['batch']:<3d} ctx={row['context']:<5d}"
    if row.get("status") != "ok":
        return f"{head} {row.get('status')} {row.get('error', '')}"
    text = (f"{head} prefill {row['prefill_s']:.2f} s ({row['prefill_tokens_per_s']:,.0f} tok/s), "
            f"decode step {row['step_ms']:.2f} ms (median {row['step_ms_median']:.2f}), peak {row['peak_gib']} GiB")
    p = row.get("profile")
    if p and "error" in p:
        text += f"\n      profiled step: {p['error']}"
    elif p:
        text += (f"\n      profiled step: wall {p['wall_ms_profiled']} ms, device busy {p['device_busy_ms']} ms, "
                 f"{p['kernel_launches']} launches, {p['ops']} aten ops; top: "
                 + ", ".join(f"{t['name']} {t['ms']}ms x{t['count']}" for t in p["top"][:5]))
    return text
