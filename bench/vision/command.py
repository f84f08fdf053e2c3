"""`epd bench vision`: patch-aware vision balancing (docs/design/serving.md) against round robin and random.

One seeded trace of mixed small and large images (trace.py: most requests one image, some
two or three; small images at V4.1's pixel floor, large ones up to its token budget), two parts:

  simulation  the pool at production scale: `--groups` groups of `--cards` cards, each request to a
              random group, the group's leader the serving BalancerCore under each policy, cards
              first come first served at `--us-per-patch` (sim.py), at each of `--loads`.
              Sizing: the released V4.1 rule (1,024 image tokens, 295,936 min pixels).
  real        a leader and `--workers` vision worker processes on the model (`--model-dir`, its
              vision tower and sizing), the trace driven through the prefill side's VisionClient at
              `--load` of the pool's calibrated capacity; every policy's pool runs each slice of
              the trace in turn over `--rounds` rounds (real.py). `--skip-real` leaves it out.

Each table reports p50 / p99 / mean latency (queueing + encoding, request arrival to its last
image's rows) and p99 / the patch-aware policy's p99 in the same run (above 1: the baseline is worse).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path

from bench.common.table import print_table, write_json

DEFAULT_MODEL_DIR = ".epd/models/deepseek-v41-tiny"
POLICIES = ("patches", "round_robin", "random")
QUICK = {"sim_requests": 2000, "requests": 12, "calibration": 4, "rounds": 1}
FULL = {"sim_requests": 20000, "requests": 240, "calibration": 8, "rounds": 4}


def register(subparsers) -> None:
    parser = subparsers.add_parser("vision", help="vision balancing: fewest queued patches vs round robin vs random "
                                                  "(a simulation at production scale, and real worker processes)")
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a smoke run: a short simulation, a tiny real trace")
    parser.add_argument("--json", metavar="FILE", help="also write every number to FILE")
    parser.add_argument("--seed", type=int, default=0, help="the trace's seed (default 0)")
    parser.add_argument("--policies", type=_names, default=POLICIES,
                        help="policies compared, the first the reference (default patches,round_robin,random)")
    sim = parser.add_argument_group("simulation")
    sim.add_argument("--skip-sim", action="store_true")
    sim.add_argument("--groups", type=int, default=8, help="groups (machines) (default 8)")
    sim.add_argument("--cards", type=int, default=8, help="cards per group (default 8)")
    sim.add_argument("--sim-requests", type=int, help=f"requests (default {FULL['sim_requests']})")
    sim.add_argument("--loads", type=_floats, default=(0.5, 0.7, 0.85), help="pool loads (default 0.5,0.7,0.85)")
    sim.add_argument("--us-per-patch", type=float, default=2.5, help="a card's microseconds a patch (default 2.5)")
    real = parser.add_argument_group("real processes")
    real.add_argument("--skip-real", action="store_true")
    real.add_argument("--model-dir", default=DEFAULT_MODEL_DIR, help=f"a V4.1 model with its vision tower "
                                                                     f"(default {DEFAULT_MODEL_DIR})")
    real.add_argument("--workers", type=int, default=2, help="vision worker processes (default 2)")
    real.add_argument("--requests", type=int, help=f"requests per policy window (default {FULL['requests']})")
    real.add_argument("--rounds", type=int, help=f"rounds, each a slice of the trace on every policy in "
                                                 f"turn (default {FULL['rounds']}; --quick {QUICK['rounds']})")
    real.add_argument("--load", type=float, default=0.7, help="offered load, share of the calibrated capacity "
                                                              "(default 0.7)")
    real.add_argument("--device", default="cpu", help="the workers' device; cuda spreads them over the GPUs "
                                                      "(cuda:i for worker i modulo the count) (default cpu)")
    real.add_argument("--dtype", default="float32", help="the workers' dtype (default float32)")
    real.add_argument("--torch-threads", type=int, default=1, help="each CPU worker's torch threads (default 1)")
    real.add_argument("--max-batch-patches", type=int, default=16384, help="a worker's batch budget (default 16384)")
    real.add_argument("--worker-kind", default="vision_worker", help=argparse.SUPPRESS)   # tests: a fake encoder
    real.add_argument("--workdir", help="logs of the processes (default: a temporary directory)")
    add_ttft_arguments(parser)


def add_ttft_arguments(parser: argparse.ArgumentParser) -> None:
    ttft = parser.add_argument_group(
        "--ttft: TTFT of requests with images on whole local stacks, one per policy",
        "bench/vision/ttft.py. It also takes --requests (per policy; default 120, --quick 6), --rounds "
        "(default 3), --seed, --policies, --model-dir, --torch-threads, --max-batch-patches, --workdir, --json, "
        "and --device / --dtype, given as they are to every vision worker and engine of the stacks.")
    ttft.add_argument("--ttft", action="store_true", help="run this part alone (the simulation and the real "
                                                          "part are skipped)")
    ttft.add_argument("--rate", type=float, default=2.0, help="requests per second, Poisson arrivals (default 2)")
    ttft.add_argument("--vision-workers", type=int, default=4, help="vision_worker replicas per stack (default 4)")
    ttft.add_argument("--max-tokens", type=int, default=4, help="tokens out per request (default 4)")
    ttft.add_argument("--topology", help="topology name or file (default: the default stack)")
    ttft.add_argument("--vision-cpus", metavar="CPUS", help="CPU list (e.g. 8-15) for every stack's vision balancer "
                                                            "and workers; with --stack-cpus")
    ttft.add_argument("--stack-cpus", metavar="CPUS", help="CPU list (e.g. 0-7) for every other service, the "
                                                           "supervisors and this client")


def _names(text: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in text.split(",") if v.strip())
    unknown = set(names) - set(POLICIES)
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"policies are {', '.join(POLICIES)}; got {text!r}")
    return names


def _floats(text: str) -> tuple[float, ...]:
    values = tuple(float(v) for v in text.split(",") if v.strip())
    if not values or not all(0 < v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"loads are fractions in (0, 1), got {text!r}")
    return values


def summary(latencies_s: list[float]) -> dict:
    ordered = sorted(latencies_s)
    if not ordered:
        return {"n": 0, "p50_ms": None, "p99_ms": None, "mean_ms": None}

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 3)
    return {"n": len(ordered), "p50_ms": at(0.50), "p99_ms": at(0.99),
            "mean_ms": round(statistics.fmean(ordered) * 1e3, 3)}


def _ratio(value, reference) -> str:
    return f"{value / reference:.2f}x" if value and reference else ""


def run_simulation(args, settings: dict) -> list[dict]:
    from messages.images import VisionSizing
    from bench.vision.sim import CostModel, arrival_scale, simulate
    from bench.vision.trace import mixed_trace, spread
    sizing = VisionSizing()
    trace = mixed_trace(settings["sim_requests"], 1.0, sizing, seed=args.seed)
    cost = CostModel(s_per_patch=args.us_per_patch * 1e-6)
    cards = args.groups * args.cards
    rows, out = [], []
    for load in args.loads:
        scale = arrival_scale(trace, cards, load, cost)
        results = {p: summary(simulate(trace, args.groups, args.cards, p, cost, scale, seed=args.seed))
                   for p in args.policies}
        reference = results[args.policies[0]]
        for policy, result in results.items():
            rows.append([f"{load:.2f}", policy, result["p50_ms"], result["p99_ms"], result["mean_ms"],
                         _ratio(result["p99_ms"], reference["p99_ms"]), _ratio(result["p50_ms"], reference["p50_ms"])])
            out.append({"load": load, "policy": policy, **result})
    low, high = spread(trace)
    print_table(["load", "policy", "p50 ms", "p99 ms", "mean ms", f"p99 / {args.policies[0]}",
                 f"p50 / {args.policies[0]}"], rows,
                title=f"simulation: {args.groups} groups x {args.cards} cards, {len(trace):,} requests, images "
                      f"{low:,}-{high:,} patches ({high / low:.1f}x), {args.us_per_patch} us a patch")
    return out


def run_real_part(args, settings: dict) -> dict:
    from messages.images import VisionSizing
    from bench.vision.real import run_real, trace_images
    from bench.vision.trace import mixed_trace, spread
    config_path = Path(args.model_dir) / "config.json"
    if not config_path.is_file():
        raise SystemExit(f"epd bench vision: {config_path} does not exist (`epd model init --arch v4.1`, or "
                         f"--model-dir; --skip-real leaves the real part out)")
    sizing = VisionSizing.from_config(json.loads(config_path.read_text()))
    calibration = settings["calibration"]
    trace = mixed_trace(settings["requests"] + calibration, 1.0, sizing, seed=args.seed)
    images = trace_images(trace, sizing, args.seed)
    warm, trace, images = images[:calibration], trace[calibration:], images[calibration:]
    worker_settings = {"model_dir": str(Path(args.model_dir).resolve()), "device": args.device, "dtype": args.dtype,
                       "torch_threads": args.torch_threads, "max_batch_patches": args.max_batch_patches}
    devices = _devices(args.device, args.workers)
    with tempfile.TemporaryDirectory(prefix="epd-bench-vision-") as tmp:
        logdir = Path(args.workdir or tmp)
        logdir.mkdir(parents=True, exist_ok=True)
        result = asyncio.run(run_real(trace, images, list(args.policies), args.workers, worker_settings, args.load,
                                      logdir, args.seed, warm, rounds=settings["rounds"],
                                      worker_kind=args.worker_kind, devices=devices))
    windows = result["windows"]
    summaries = {w.policy: summary(w.latencies_s) for w in windows}
    reference = summaries[args.policies[0]]
    rows = [[w.policy, f"{summaries[w.policy]['n']}/{len(trace)}", summaries[w.policy]["p50_ms"],
             summaries[w.policy]["p99_ms"], summaries[w.policy]["mean_ms"],
             _ratio(summaries[w.policy]["p99_ms"], reference["p99_ms"]),
             _ratio(summaries[w.policy]["p50_ms"], reference["p50_ms"]),
             ", ".join(f"{k} {v}" for k, v in w.errors.items())] for w in windows]
    low, high = spread(trace)
    print_table(["policy", "done", "p50 ms", "p99 ms", "mean ms", f"p99 / {args.policies[0]}",
                 f"p50 / {args.policies[0]}", "errors"], rows,
                title=f"real processes: {args.workers} vision workers ({args.device}, {args.dtype}), "
                      f"{Path(args.model_dir).name}, {len(trace)} requests at {args.load:.0%} load in "
                      f"{settings['rounds']} round(s), images "
                      f"{low:,}-{high:,} patches ({high / low:.1f}x)")
    return {"s_per_patch": result["s_per_patch"], "rate": result["rate"], "rounds": settings["rounds"],
            "workers": args.workers, "device": args.device,
            "dtype": args.dtype, "load": args.load, "requests": len(trace),
            "windows": [{"policy": w.policy, **summaries[w.policy], "errors": w.errors,
                         "wall_s": round(w.wall_s, 3), "latency_ms": [round(x * 1e3, 3) for x in w.latencies_s]}
                        for w in windows]}


def _devices(device: str, workers: int) -> list[str] | None:
    if device != "cuda":
        return None
    import torch
    count = torch.cuda.device_count()
    if not count:
        raise SystemExit("epd bench vision: --device cuda, but no GPU is visible")
    return [f"cuda:{i % count}" for i in range(workers)]


def run(args: argparse.Namespace) -> int:
    if args.ttft:
        from bench.vision.ttft import run_ttft
        return run_ttft(args)
    from services.runtime.logs import configure_logging
    configure_logging("warning")   # the bench client's per-message lines would bury the tables
    settings = {**(QUICK if args.quick else FULL)}
    if args.sim_requests:
        settings["sim_requests"] = args.sim_requests
    if args.requests:
        settings["requests"] = args.requests
    if args.rounds:
        settings["rounds"] = args.rounds
    if args.groups < 1 or args.cards < 1 or args.workers < 1:
        raise SystemExit("epd bench vision: --groups, --cards and --workers must be >= 1")
    results: dict = {"seed": args.seed, "policies": list(args.policies)}
    if not args.skip_sim:
        results["simulation"] = run_simulation(args, settings)
    if not args.skip_real:
        results["real"] = run_real_part(args, settings)
    if args.json:
        write_json(args.json, "vision", results)
    return 0
