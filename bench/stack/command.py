"""`epd bench stack`: the whole disaggregated stack against the engine alone, on the same requests.

  stack   the topology (default: the E/P/D form) as real processes (`epd up --detach`, in a private
          working directory: its own run root, KV store and ports; `epd down` at the end, always),
          driven over HTTP: `--streams` concurrent streaming Chat Completions per round.
  engine  one EngineCore in this process with the workers' engine settings (model, dtype, pages,
          batch limits), loaded and stepped on a thread of its own as a worker steps its engine,
          the same round's requests added at once and stepped until done.

The requests (workload.py) are a seeded set: `--rounds` x `--streams` user messages of
`--min-prompt`..`--max-prompt` tokens, greedy, `--max-tokens` each, thinking off. The engine gets
the prompt ids and SamplingParams that the gateway's own adapter makes of each body (the chat
template rendered and tokenized exactly as the gateway does), so both sides compute the same thing
and their greedy outputs must be equal: tokens counted and text (the engine's tokens through the
gateway's response stream) compared request by request; any difference is a bug, reported loudly
(exit status 1). The HTTP API has no ignore_eos: both sides stop at EOS alike.

GPUs. `--topology gpu2` runs the stack with its workers pinned to GPUs (prefill on 0, decode on 1;
ops/topologies/gpu2.toml); `--prefill-gpu N` / `--decode-gpu N` pin the topology's prefill or decode
worker (one replica) to GPU N instead, with device "cuda" (ops/topology.py: the process sees that
GPU alone). The engine alone runs on one GPU of this process: `--engine-gpu N` (default: the
workers' device, "cuda" = GPU 0). It stays loaded while the stack's rounds run, so its GPU holds one
more copy of the model (it is idle then: the sides take turns).

Rounds alternate which side goes first, so background load falls on both alike; one warm-up round
per side (prompts like the measured ones, 4 tokens out) is not measured. TTFT is per request from
its round's start (sides.py says what marks the first token on each side); "added" is the
per-request difference stack - engine on the same request. tokens/s = completion tokens / wall
time, over all rounds and per round; the verdict takes the median over rounds of the stack/engine
ratio on the same round's requests (a burst of load on a shared machine then spoils one round, not
the verdict). Target: >= 0.9x; the added TTFT and the CPU time per output token (the stack's
service processes against this process during the engine's rounds) are reported.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common.table import machine, print_table, write_json

TOKENS_TARGET = 0.9                  # stack tokens/s / engine tokens/s
DEFAULT_MODEL = ".epd/models/deepseek-v41-tiny"
WARMUP_TOKENS = 4                    # the warm-up round: prompts like the measured ones, 4 tokens out


def register(subparsers) -> None:
    parser = subparsers.add_parser("stack", help="the E/P/D stack over HTTP vs the engine alone: added TTFT, tokens/s")
    parser.add_argument("--topology",
                        help="topology name or file (default: `default` when it is the E/P/D form, else `epd`)")
    parser.add_argument("--prefill-gpu", type=int, metavar="N",
                        help="pin the topology's prefill worker to GPU N (device cuda; default: as the topology says)")
    parser.add_argument("--decode-gpu", type=int, metavar="N",
                        help="pin the topology's decode worker to GPU N (device cuda; default: as the topology says)")
    parser.add_argument("--engine-gpu", type=int, metavar="N",
                        help="run the engine alone on GPU N of this process (default: the workers' device)")
    parser.add_argument("--streams", type=int, default=8, help="concurrent requests per round (default 8)")
    parser.add_argument("--rounds", type=int, default=4, help="measured rounds per side (default 4)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    parser.add_argument("--min-prompt", type=int, default=100, help="shortest prompt in tokens (default 100)")
    parser.add_argument("--max-prompt", type=int, default=1500, help="longest prompt in tokens (default 1500)")
    parser.add_argument("--engine-threads", type=int, default=0,
                        help="torch CPU threads of the engine alone (default 0: torch's default, every core)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the request set (default 0)")
    parser.add_argument("--budget-s", type=float, help="start no new round after this many seconds of measuring")
    parser.add_argument("--model-dir", default=DEFAULT_MODEL,
                        help=f"the model the stack serves (default {DEFAULT_MODEL}, made as `make model` does)")
    parser.add_argument("--workdir", help="the stack's working directory (default: a temporary one, removed after)")
    parser.add_argument("--json", metavar="FILE", help="also write every number to FILE")
    parser.add_argument("--plot", metavar="FILE",
                        help="also draw TTFT and tokens/s, stack against engine, to FILE (PNG)")
    parser.add_argument("--plot-from", nargs="+", metavar="JSON",
                        help="run nothing: draw --plot from recorded --json results (several, at different "
                             "--streams: TTFT and tokens/s against concurrency)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from bench.common.local_stack import LocalStack, default_topology
    from services.runtime.logs import configure_logging
    error = _check_args(args)
    if error:
        print(f"epd bench stack: {error}", file=sys.stderr)
        return 2
    if args.plot_from:
        return _plot_recorded(args.plot_from, args.plot)
    configure_logging("warning")
    topology = args.topology or default_topology()
    model_dir = _model_dir(args.model_dir)
    if model_dir is None:
        print(f"epd bench stack: no model at {args.model_dir} (make one with `epd model init`)", file=sys.stderr)
        return 2
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="epd-bench-stack-"))
    keep = bool(args.workdir)
    try:
        results = measure(args, LocalStack(topology, model_dir, workdir, gpus=pinned_gpus(args)), topology)
    except (RuntimeError, ValueError, OSError, subprocess.SubprocessError) as exc:
        started = (workdir / "runs").exists()
        keep = keep or started
        logs = f"\n  (the stack's logs are kept in {workdir / 'runs'})" if started else ""
        print(f"epd bench stack: {exc}{logs}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("epd bench stack: interrupted; the stack is stopped", file=sys.stderr)
        return 130
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    date = write_json(args.json, "stack", results)["date"] if args.json else _now()
    report(results, date)
    if args.plot:
        from bench.stack.plot import write_plot
        print(f"plot: {write_plot([{**results, 'date': date}], args.plot)}")
    bad = {(m["round"], m["stream"]) for m in results["mismatches"]}
    if bad:
        print(f"epd bench stack: OUTPUT MISMATCH in {len(bad)} of {results['requests']} requests: "
              "the stack and the engine computed different tokens for the same greedy request (a bug); "
              "see the JSON 'mismatches'", file=sys.stderr)
        return 1
    return 0


def _check_args(args: argparse.Namespace) -> str:
    if min(args.streams, args.rounds, args.max_tokens) < 1:
        return "--streams, --rounds and --max-tokens must be >= 1"
    if not 1 <= args.min_prompt <= args.max_prompt:
        return "need 1 <= --min-prompt <= --max-prompt"
    if args.budget_s is not None and args.budget_s <= 0:
        return "--budget-s must be > 0"
    if args.engine_threads < 0:
        return "--engine-threads must be >= 0"
    if args.plot_from and not args.plot:
        return "--plot-from needs --plot FILE"
    for flag in ("prefill_gpu", "decode_gpu", "engine_gpu"):
        if getattr(args, flag) is not None and getattr(args, flag) < 0:
            return f"--{flag.replace('_', '-')} must be a GPU index >= 0"
    return ""


def _plot_recorded(paths: list[str], out: str) -> int:
    import json
    from bench.stack.plot import write_plot
    try:
        results = [json.loads(Path(p).read_text()) for p in paths]
    except (OSError, ValueError) as exc:
        print(f"epd bench stack: cannot read a recorded result: {exc}", file=sys.stderr)
        return 2
    print(f"plot: {write_plot(results, out)}")
    return 0


def pinned_gpus(args: argparse.Namespace) -> dict[str, int]:
    """Worker kind -> the GPU --prefill-gpu / --decode-gpu pin it to."""
    pins = {"prefill_worker": args.prefill_gpu, "decode_worker": args.decode_gpu}
    return {kind: gpu for kind, gpu in pins.items() if gpu is not None}


def engine_device(settings: dict, engine_gpu: int | None) -> str:
    """The engine alone's device: GPU `engine_gpu` of this process, else the workers' device."""
    if engine_gpu is not None:
        return f"cuda:{engine_gpu}"
    return settings.get("device", "cpu")


def _model_dir(path: str) -> Path | None:
    """The model directory; the default one is made as `make model` makes it when missing."""
    model_dir = Path(path)
    if not (model_dir / "config.json").exists() and path == DEFAULT_MODEL:
        from engine.models.v41.random_init import write_random_v41_model_dir
        _progress(f"writing the tiny model to {model_dir} (epd model init --arch v4.1 --seed 0)")
        write_random_v41_model_dir("tiny-v41", model_dir, seed=0)
    return model_dir if (model_dir / "config.json").exists() else None


def _progress(what: str) -> None:
    print(f"epd bench stack: [{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def _now() -> str:
    import datetime
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ---- the run ------------------------------------------------------------------------------------
def measure(args: argparse.Namespace, stack, topology: str) -> dict:
    from bench.stack.sides import EngineSide, StackSide
    from bench.stack.workload import Workload
    load_before = os.getloadavg()[0]
    _progress(f"building {args.rounds} x {args.streams} requests with the gateway's adapter")
    workload = Workload(stack.gateway_settings(), stack.workdir)
    prompt_range = (args.min_prompt, args.max_prompt)
    rounds = workload.requests(args.rounds, args.streams, prompt_range, args.max_tokens, args.seed)
    warmup = workload.requests(1, args.streams, prompt_range, WARMUP_TOKENS, args.seed + 1, label="warmup")[0]
    settings = {**stack.engine_settings(), "torch_threads": args.engine_threads}
    settings["device"] = engine_device(settings, args.engine_gpu)
    gpus = stack.worker_gpus()
    _progress(f"loading the engine ({settings['model_dir']}, {settings['device']}, dtype {settings.get('dtype')}, "
              f"torch threads {args.engine_threads or 'default'})")
    engine = EngineSide(settings)
    pinned = ", ".join(f"{instance} on GPU {gpu}" for instance, gpu in gpus.items())
    _progress(f"starting the stack (topology {topology}, ports {stack.port_base}+, HTTP {stack.url}"
              f"{'; ' + pinned if pinned else ''})")
    with stack:
        _progress("stack ready; warming up both sides")
        sides = {"engine": engine, "stack": StackSide(stack.url, stack.service_pids())}
        for side in sides.values():
            side.run_round(-1, warmup)
        measured, started = [], time.monotonic()
        for index, requests in enumerate(rounds):
            if index and args.budget_s is not None and time.monotonic() - started > args.budget_s:
                _progress(f"--budget-s {args.budget_s:g} spent: stopping after {index} rounds")
                break
            for name in (("engine", "stack") if index % 2 == 0 else ("stack", "engine")):
                _progress(f"round {index + 1}/{len(rounds)}: {name}")
                measured.append(sides[name].run_round(index, requests))
        _progress("done; stopping the stack (epd down)")
    done = {r.index for r in measured}
    return {"topology": topology, "topology_file": str(stack.topology.source), "streams": args.streams,
            "rounds": len(done), "max_tokens": args.max_tokens, "prompt_tokens_range": list(prompt_range),
            "seed": args.seed, "engine_settings": settings, "gpus": gpus, "gpu_names": gpu_names(),
            "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "requests": len(done) * args.streams, "warmup_requests": len(warmup),
            "per_round": [_round_row(r) for r in measured],
            "per_request": [o.row(r.side) for r in measured for o in r.outcomes],
            "mismatches": compare_outputs(measured), **summarize(measured)}


def gpu_names() -> list[str]:
    """This host's GPUs by index (what the pins point at); [] without CUDA."""
    try:
        import torch
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except (ImportError, RuntimeError):
        return []


def _round_row(r) -> dict:
    ttft = [o.ttft_s for o in r.outcomes]
    return {"side": r.side, "round": r.index, "requests": len(r.outcomes),
            "prompt_tokens": sum(o.prompt_tokens for o in r.outcomes), "completion_tokens": r.tokens,
            "cached_tokens": sum(o.cached_tokens for o in r.outcomes), "wall_s": round(r.wall_s, 3),
            "cpu_s": round(r.cpu_s, 3),
            "tokens_per_s": round(r.tokens / r.wall_s, 2), "ttft_ms_p50": _ms(pick(ttft, 0.5)),
            "ttft_ms_max": _ms(max(ttft))}


def compare_outputs(rounds) -> list[dict]:
    """Every request's engine and stack outcome: equal token count, finish reason and text."""
    by_key = {}
    for r in rounds:
        for o in r.outcomes:
            by_key.setdefault((o.round, o.stream), {})[r.side] = o
    mismatches = []
    for (round_, stream), sides in sorted(by_key.items()):
        engine, stack = sides.get("engine"), sides.get("stack")
        if engine is None or stack is None:
            continue
        for field in ("prompt_tokens", "completion_tokens", "finish_reason", "text"):
            a, b = getattr(engine, field), getattr(stack, field)
            if a == b:
                continue
            at = None
            if field == "text":   # where the texts part, and the start of each
                at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                a, b = a[:200], b[:200]
            mismatches.append({"round": round_, "stream": stream, "field": field, "first_difference_at": at,
                               "engine": a, "stack": b})
    return mismatches


def summarize(rounds) -> dict:
    sides = {}
    for name in ("engine", "stack"):
        mine = [r for r in rounds if r.side == name]
        ttft = [o.ttft_s for r in mine for o in r.outcomes]
        tokens, wall, cpu = sum(r.tokens for r in mine), sum(r.wall_s for r in mine), sum(r.cpu_s for r in mine)
        sides[name] = {"ttft_ms_p50": _ms(pick(ttft, 0.5)), "ttft_ms_p99": _ms(pick(ttft, 0.99)),
                       "completion_tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 2),
                       "cpu_s": round(cpu, 3), "cpu_ms_per_token": _ms(cpu / tokens)}
    engine_ttft = {(o.round, o.stream): o.ttft_s for r in rounds if r.side == "engine" for o in r.outcomes}
    added = [o.ttft_s - engine_ttft[o.round, o.stream] for r in rounds if r.side == "stack" for o in r.outcomes
             if (o.round, o.stream) in engine_ttft]
    by_round = {(r.side, r.index): r.tokens / r.wall_s for r in rounds}
    round_ratios = [by_round["stack", i] / by_round["engine", i] for side, i in by_round
                    if side == "engine" and ("stack", i) in by_round]
    median = statistics.median(round_ratios)
    return {"engine": sides["engine"], "stack": sides["stack"],
            "added_ttft_ms_p50": _ms(pick(added, 0.5)), "added_ttft_ms_p99": _ms(pick(added, 0.99)),
            "tokens_per_s_ratio": round(sides["stack"]["tokens_per_s"] / sides["engine"]["tokens_per_s"], 3),
            "tokens_per_s_round_ratios": [round(x, 3) for x in round_ratios],
            "tokens_per_s_ratio_median_round": round(median, 3), "tokens_per_s_target": TOKENS_TARGET,
            "cpu_per_token_ratio": round(sides["stack"]["cpu_s"] / sides["engine"]["cpu_s"], 3)
            if sides["engine"]["cpu_s"] else None,
            "verdict": "ok" if median >= TOKENS_TARGET else "MISS"}


def pick(values: list[float], q: float) -> float:
    """Nearest-rank percentile (p99 of fewer than 100 samples is the largest)."""
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _x(ratio: float | None) -> str:
    return "" if ratio is None else f"{ratio:.2f}x"


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 2)


# ---- output -------------------------------------------------------------------------------------
def _gpu_note(results: dict) -> str:
    """Where the pinned workers and the engine alone ran, for the summary's title; "" when nothing is pinned."""
    gpus, names = results.get("gpus") or {}, results.get("gpu_names") or []
    if not gpus:
        return ""
    host = f"{len(names)} x {', '.join(sorted(set(names)))}" if names else "no GPU seen by the bench"
    pins = ", ".join(f"{instance} on GPU {gpu}" for instance, gpu in gpus.items())
    return f"; host GPUs: {host}; {pins}, engine alone on {results['engine_settings'].get('device')}"


def report(results: dict, date: str) -> None:
    m = machine()
    print_table(["round", "side", "requests", "prompt tokens", "output tokens", "cached", "wall s", "CPU s",
                 "tokens/s", "TTFT p50 ms", "TTFT max ms"],
                [[r["round"] + 1, r["side"], r["requests"], r["prompt_tokens"], r["completion_tokens"],
                  r["cached_tokens"], r["wall_s"], r["cpu_s"], r["tokens_per_s"], r["ttft_ms_p50"], r["ttft_ms_max"]]
                 for r in results["per_round"]],
                title=f"\nepd bench stack: topology {results['topology']}, {results['streams']} streams x "
                      f"{results['rounds']} rounds, prompts {results['prompt_tokens_range'][0]}-"
                      f"{results['prompt_tokens_range'][1]} tokens, {results['max_tokens']} tokens out, greedy")
    engine, stack = results["engine"], results["stack"]
    equal = results["requests"] - len({(x["round"], x["stream"]) for x in results["mismatches"]})
    where = _gpu_note(results)
    print_table(["measure", "engine", "stack", "added", "stack/engine", "target", "verdict"],
                [["TTFT p50 ms", engine["ttft_ms_p50"], stack["ttft_ms_p50"], f"{results['added_ttft_ms_p50']:+,.1f}",
                  "", "none (reported)", ""],
                 ["TTFT p99 ms", engine["ttft_ms_p99"], stack["ttft_ms_p99"], f"{results['added_ttft_ms_p99']:+,.1f}",
                  "", "none (reported)", ""],
                 ["tokens/s, all rounds", engine["tokens_per_s"], stack["tokens_per_s"], "",
                  _x(results["tokens_per_s_ratio"]), "", ""],
                 ["tokens/s, median round", "", "", "", _x(results["tokens_per_s_ratio_median_round"]),
                  f">= {TOKENS_TARGET}x", results["verdict"]],
                 ["CPU ms / output token", engine["cpu_ms_per_token"], stack["cpu_ms_per_token"], "",
                  _x(results["cpu_per_token_ratio"]), "none (reported)", ""],
                 ["equal outputs", "", "", "", f"{equal}/{results['requests']}", "all",
                  "ok" if not results["mismatches"] else "MISMATCH"]],
                title=f"\nstack vs engine alone: {date}, {m['cpu_model']}, {m['cores_usable']}/{m['cores']} cores, "
                      f"load {results['load_avg_1m'][0]:g}->{results['load_avg_1m'][1]:g}{where}; "
                      "added = per-request stack - engine TTFT on the same request")
