"""The numbers of `epd bench grammar --ttft`: the order windows run in, per-side and per-window
summaries, loaded / baseline ratios and the verdict, and the two tables."""
from __future__ import annotations

from dataclasses import dataclass

from bench.grammar.ttft_load import LoadWindow
from bench.common.plain_traffic import PlainOutcome
from bench.stack.command import pick
from bench.common.table import ms, print_table, ratio, times

SIDES = ("baseline", "loaded")
P99_TARGET = 1.05             # loaded p99 TTFT / baseline p99 TTFT must stay below this


@dataclass(slots=True)
class Window:
    side: str                  # "baseline" | "loaded"
    round: int
    outcomes: list[PlainOutcome]
    wall_s: float
    load: LoadWindow | None    # the grammar load's window (loaded side only)


def window_order(rounds: int) -> list[tuple[int, str]]:
    """(round, side) in the order they run: the sides alternate, and which one opens a round
    alternates too (B L, L B, B L, ...), so a drift over the run falls on both sides alike."""
    order = []
    for round_ in range(rounds):
        first, second = SIDES if round_ % 2 == 0 else SIDES[::-1]
        order += [(round_, first), (round_, second)]
    return order


def summarize(windows: list[Window]) -> dict:
    sides = {side: _side([w for w in windows if w.side == side]) for side in SIDES}
    base, loaded = sides["baseline"], sides["loaded"]
    ratios = {q: ratio(loaded[f"ttft_ms_{q}"], base[f"ttft_ms_{q}"]) for q in ("p50", "p90", "p99")}
    by_request = {(o.round, o.index): o.ttft_s for w in windows if w.side == "baseline" for o in w.outcomes}
    added = [o.ttft_s - by_request[o.round, o.index] for w in windows if w.side == "loaded" for o in w.outcomes
             if (o.round, o.index) in by_request]
    return {"baseline": base, "loaded": loaded, "ratio": ratios,
            "added_ttft_ms_p50": ms(pick(added, 0.5)) if added else None,
            "p99_target": P99_TARGET,
            "verdict": "ok" if ratios["p99"] is not None and ratios["p99"] < P99_TARGET else "MISS",
            "per_window": [window_row(w, windows) for w in windows]}


def _side(windows: list[Window]) -> dict:
    outcomes = [o for w in windows for o in w.outcomes]
    ttft = [o.ttft_s for o in outcomes]
    loads = [w.load for w in windows if w.load is not None]
    latencies = [x for load in loads for x in load.latencies_s]
    service = [x for load in loads for x in load.compile_ms]
    errors: dict[str, int] = {}
    for load in loads:
        for code, count in load.errors.items():
            errors[code] = errors.get(code, 0) + count
    return {"requests": len(outcomes), "windows": len(windows),
            "ttft_ms_p50": ms(pick(ttft, 0.5)) if ttft else None,
            "ttft_ms_p90": ms(pick(ttft, 0.9)) if ttft else None,
            "ttft_ms_p99": ms(pick(ttft, 0.99)) if ttft else None,
            "ttft_ms_max": ms(max(ttft)) if ttft else None,
            "without_text": sum(not o.has_text for o in outcomes),
            "cached_tokens": sum(o.cached_tokens for o in outcomes),
            "late_ms_max": ms(max((o.late_s for o in outcomes), default=0.0)),
            "wall_s": round(sum(w.wall_s for w in windows), 3),
            "compiles_sent": sum(load.sent for load in loads),
            "compiles_done": len(latencies),
            "compile_ms_p50": ms(pick(latencies, 0.5)) if latencies else None,
            "compile_service_ms_p50": round(pick(service, 0.5), 2) if service else None,
            "compiles_cached": sum(load.cached for load in loads), "compile_errors": errors}


def window_row(window: Window, windows: list[Window]) -> dict:
    ttft = [o.ttft_s for o in window.outcomes]
    other = next((w for w in windows if w.round == window.round and w.side != window.side), None)
    row = {"round": window.round, "side": window.side, "requests": len(ttft), "wall_s": round(window.wall_s, 3),
           "ttft_ms_p50": ms(pick(ttft, 0.5)) if ttft else None,
           "ttft_ms_max": ms(max(ttft)) if ttft else None,
           "compiles_done": window.load.done if window.load else 0,
           "compile_ms_p50": ms(pick(window.load.latencies_s, 0.5)) if window.load and window.load.done else None,
           "requests_detail": [o.row() for o in window.outcomes]}
    if window.side == "loaded" and other is not None and other.outcomes and ttft:
        row["p50_vs_baseline"] = ratio(pick(ttft, 0.5), pick([o.ttft_s for o in other.outcomes], 0.5))
    if window.load is not None:
        row["load"] = window.load.row()
    return row


def report(results: dict, header: str) -> None:
    print_table(["round", "side", "requests", "wall s", "TTFT p50 ms", "TTFT max ms", "p50 vs baseline",
                 "compiles done", "compile p50 ms"],
                [[w["round"] + 1, w["side"], w["requests"], w["wall_s"], w["ttft_ms_p50"], w["ttft_ms_max"],
                  times(w.get("p50_vs_baseline")), w["compiles_done"] if w["side"] == "loaded" else "",
                  w["compile_ms_p50"]] for w in results["per_window"]],
                title=f"\n{header}\nwindows, in the order they ran:")
    vs = results["ratio"]
    rows = []
    for side in SIDES:
        s = results[side]
        mine = side == "loaded"
        rows.append([side, s["requests"], s["ttft_ms_p50"], s["ttft_ms_p90"], s["ttft_ms_p99"],
                     times(vs["p50"]) if mine else "", times(vs["p90"]) if mine else "",
                     times(vs["p99"]) if mine else "", s["compiles_done"] if mine else "",
                     s["compile_ms_p50"] if mine else "", _status(s)])
    print_table(["side", "requests", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "p50 vs base", "p90 vs base",
                 "p99 vs base", "compiles done", "compile p50 ms", "notes"], rows,
                title=f"\nTTFT of plain requests while heavy grammars compile (target: p99 vs base < "
                      f"{P99_TARGET:g}x): {results['verdict']}")


def _status(side: dict) -> str:
    notes = []
    if side["compile_errors"]:
        notes.append("compile errors " + ", ".join(f"{k} {v}" for k, v in side["compile_errors"].items()))
    if side["compiles_cached"]:
        notes.append(f"{side['compiles_cached']} compiles from the cache (salt reused?)")
    if side["without_text"]:
        notes.append(f"{side['without_text']} without text (first event)")
    if side["cached_tokens"]:
        notes.append(f"{side['cached_tokens']} prompt tokens from the cache")
    return "; ".join(notes)



