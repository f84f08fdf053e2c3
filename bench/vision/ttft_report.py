"""The numbers of `epd bench vision --ttft`: per policy TTFT and vision-side percentiles, their
ratios to the reference policy's (the first), per window rows, and the two tables."""
from __future__ import annotations

from dataclasses import dataclass

from bench.common.plain_traffic import PlainOutcome
from bench.stack.command import pick
from bench.common.table import ms, print_table, ratio, times


@dataclass(slots=True)
class Window:
    policy: str
    round: int
    outcomes: list[PlainOutcome]
    wall_s: float
    started: float      # epoch seconds: which of the workers' batches fell in the window
    ended: float

    def request_ids(self) -> list[str]:
        return [f"{self.policy}-{o.round}-{o.index}" for o in self.outcomes]   # run_window's ids


def summarize(windows: list[Window], logs: dict, retries: dict[str, int], policies: list[str]) -> dict:
    """`logs`: policy -> its stack's WorkerLogs; `retries`: policy -> the prefill side's vision retries."""
    per_policy = {p: _policy([w for w in windows if w.policy == p], logs[p], retries.get(p, 0)) for p in policies}
    reference = per_policy[policies[0]]
    for result in per_policy.values():
        result["vs_reference"] = {key: ratio(result[key], reference[key])
                                  for key in ("ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "vision_ms_p99")}
    return {"per_policy": per_policy, "per_window": [_window_row(w, logs[w.policy]) for w in windows]}


def _policy(windows: list[Window], logs, retries: int) -> dict:
    outcomes = [o for w in windows for o in w.outcomes]
    ttft = [o.ttft_s for o in outcomes]
    ids = [r for w in windows for r in w.request_ids()]
    vision = list(logs.vision_s(ids).values())
    encode = [ms for w in windows for ms in logs.encode_ms_between(w.started, w.ended)]
    shares = logs.patch_shares(ids)
    mean_share = sum(shares.values()) / len(shares) if shares else 0
    return {"requests": len(outcomes), "windows": len(windows), "wall_s": round(sum(w.wall_s for w in windows), 3),
            **_percentiles("ttft_ms", ttft), "ttft_ms_max": ms(max(ttft)) if ttft else None,
            "vision_requests": len(vision), **_percentiles("vision_ms", vision),
            "batch_encode_ms_p50": round(pick(encode, 0.5), 3) if encode else None,
            "batch_encode_ms_p99": round(pick(encode, 0.99), 3) if encode else None, "batches": len(encode),
            "patches_per_worker": shares,
            "busiest_over_mean": round(max(shares.values()) / mean_share, 3) if mean_share else None,
            "without_text": sum(not o.has_text for o in outcomes),
            "cached_tokens": sum(o.cached_tokens for o in outcomes),
            "prompt_tokens": sum(o.prompt_tokens for o in outcomes),
            "late_ms_max": ms(max((o.late_s for o in outcomes), default=0.0)),
            "vision_retries": retries, "unmatched_worker_logs": sorted(set(logs.unmatched))}


def _window_row(window: Window, logs) -> dict:
    ttft = [o.ttft_s for o in window.outcomes]
    vision = list(logs.vision_s(window.request_ids()).values())
    return {"round": window.round, "policy": window.policy, "requests": len(ttft), "wall_s": round(window.wall_s, 3),
            "ttft_ms_p50": ms(pick(ttft, 0.5)) if ttft else None, "ttft_ms_max": ms(max(ttft)) if ttft else None,
            "vision_ms_p50": ms(pick(vision, 0.5)) if vision else None,
            "vision_ms_max": ms(max(vision)) if vision else None,
            "requests_detail": [o.row() for o in window.outcomes]}


def _percentiles(name: str, seconds: list[float]) -> dict:
    return {f"{name}_p{q}": ms(pick(seconds, q / 100)) if seconds else None for q in (50, 90, 99)}


def header(results: dict) -> str:
    pin = results["pinning"]
    if pin["mode"] == "pinned":
        workers = sorted({cpus for name, cpus in pin["groups"].items() if name.startswith("vision_worker")})
        each = "each on its own CPUs" if len(workers) > 1 else "sharing them"
        pinning = (f"pinned: vision pools on CPUs {pin['vision_cpus']} (workers {each}: {' | '.join(workers)}), "
                   f"everything else on {pin['stack_cpus']}")
    else:
        pinning = "no pinning (every stack and this client share every CPU)"
    sizes, (low, high) = results["sizes"], results["patches_range"]
    return (f"epd bench vision --ttft: host {results['cpus']} CPUs ({results['cpus_usable']} usable), {pinning}; "
            f"topology {results['topology']} x {len(results['policies'])} stacks, {results['vision_workers']} vision "
            f"workers each ({results['device']}, {results['dtype']}, {results['torch_threads']} torch thread(s)); "
            f"{sizes['requests']} requests per policy ({results['images']} images, {low:,}-{high:,} patches) in "
            f"{sizes['rounds']} round(s) at {results['rate_per_s']:g}/s, seed {results['seed']}, "
            f"{results['max_tokens']} tokens out; load {results['load_avg_1m'][0]:g}->{results['load_avg_1m'][1]:g}")


def report(results: dict) -> None:
    print_table(["round", "policy", "requests", "wall s", "TTFT p50 ms", "TTFT max ms", "vision p50 ms",
                 "vision max ms"],
                [[w["round"] + 1, w["policy"], w["requests"], w["wall_s"], w["ttft_ms_p50"], w["ttft_ms_max"],
                  w["vision_ms_p50"], w["vision_ms_max"]] for w in results["per_window"]],
                title=f"\n{header(results)}\nwindows, in the order they ran:")
    reference = results["policies"][0]
    rows = []
    for policy, r in results["per_policy"].items():
        vs = r["vs_reference"]
        rows.append([policy, r["requests"], r["ttft_ms_p50"], r["ttft_ms_p90"], r["ttft_ms_p99"],
                     times(vs["ttft_ms_p50"]), times(vs["ttft_ms_p99"]), r["vision_ms_p50"], r["vision_ms_p99"],
                     times(vs["vision_ms_p99"]), r["batch_encode_ms_p50"], times(r["busiest_over_mean"]), _notes(r)])
    print_table(["policy", "requests", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", f"p50 / {reference}",
                 f"p99 / {reference}", "vision p50 ms", "vision p99 ms", f"vision p99 / {reference}",
                 "batch encode p50 ms", "busiest / mean patches", "notes"], rows,
                title=f"\nTTFT and vision latency per balancing policy (ratios: / {reference}, same run; "
                      "vision = first image queued at a worker -> last image encoded, from the workers' logs)")


def _notes(r: dict) -> str:
    notes = []
    if r["vision_requests"] != r["requests"]:
        notes.append(f"vision latency for {r['vision_requests']}/{r['requests']}")
    if r["vision_retries"]:
        notes.append(f"{r['vision_retries']} vision retries (the replay may be off)")
    if r["unmatched_worker_logs"]:
        notes.append(f"logs not replayed: {', '.join(r['unmatched_worker_logs'])}")
    if r["without_text"]:
        notes.append(f"{r['without_text']} without text (first event)")
    if r["cached_tokens"]:
        notes.append(f"{r['cached_tokens']} prompt tokens from the cache")
    return "; ".join(notes)



