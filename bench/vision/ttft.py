"""`epd bench vision --ttft`: TTFT of requests with images on the whole stack, its vision pool
balanced by each policy in turn (patch-aware, round robin, random), on one seeded trace.

  stacks    one local stack per policy, all up for the whole run (bench/common/local_stack.py, as `epd bench
            stack` and `grammar --ttft` start them: private working directories, KV stores and
            ports; `epd down` at the end, always): the topology (default: the default stack) with
            `--vision-workers` vision_worker replicas, its vision balancer's `policy` (seeded with
            `--seed`), the vision workers' `--device`, `--dtype`, `--torch-threads` and
            `--max-batch-patches`, and the engines' device and dtype set alike (bench/common/topology_edit.py).
  trace     trace.py's seeded mixed trace (1-3 images a request, most small, some at the
            model's token budget), Poisson arrivals at `--rate` per second; each request is one
            streaming Chat Completion: its images as JPEG data URLs (real.encoded_image),
            then a short question, greedy, `--max-tokens` out, thinking off. Every request's
            images are its own, so no request is a prefix hit on another's image blocks (the
            cached tokens are reported). Every stack gets the very same requests at the very
            same offsets.
  rounds    `--rounds` slices of the trace; each round runs its slice on every policy's stack in
            turn, the order rotating, so a busy spell of a shared host falls on every policy
            alike. A few unmeasured requests of their own warm each stack first.
  TTFT      per request, send -> first streamed text (bench/common/plain_traffic.run_window).
  vision    from the vision workers' logs (ttft_logs.py): per request, its first image
            queued at a worker -> its last image's batch encoded; the batches' encode ms; the
            busiest worker's patches over the mean (1.00: an even spread).
  pinning   `--vision-cpus` / `--stack-cpus` (CPU lists): every stack's vision balancer and
            workers on the first, each worker on a slice of its own when there are at least as
            many CPUs as workers (a card of its own: on a shared CPU the workers are not separate
            servers, and no balancing can matter much), every other service, the supervisors and
            this client on the second (bench/common/cpu_pinning.py).
Ratios are each policy's over the patch-aware policy's (the first of `--policies`), same run:
above 1, the baseline is slower.
"""
from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

TTFT_FULL = {"requests": 120, "rounds": 3}
TTFT_QUICK = {"requests": 6, "rounds": 1}
WARMUP_REQUESTS = {False: 3, True: 1}       # per stack, unmeasured; --quick: one
VISION_KINDS = ("vision_balancer", "vision_worker")
ENGINE_KINDS = ("prefill_worker", "decode_worker", "unified_worker")
QUESTION = "What do you see? Answer in one word."


def run_ttft(args) -> int:
    from bench.stack.command import _model_dir
    from services.runtime.logs import configure_logging
    sizes = {k: v if getattr(args, k, None) is None else getattr(args, k)
             for k, v in (TTFT_QUICK if args.quick else TTFT_FULL).items()}
    error, pins = _check(args, sizes)
    model_dir = None if error else _model_dir(args.model_dir)
    if not error and model_dir is None:
        error = f"no model at {args.model_dir} (make one with `epd model init --arch v4.1`)"
    if error:
        print(f"epd bench vision: {error}", file=sys.stderr)
        return 2
    configure_logging("warning")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="epd-bench-vision-ttft-"))
    keep = bool(args.workdir)
    try:
        results = measure(args, sizes, model_dir, workdir, pins)
    except (RuntimeError, ValueError, OSError, subprocess.SubprocessError) as exc:
        started = any(workdir.glob("*/runs"))
        keep = keep or started
        logs = f"\n  (the stacks' logs are kept in {workdir})" if started else ""
        print(f"epd bench vision: {exc}{logs}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("epd bench vision: interrupted; the stacks are stopped", file=sys.stderr)
        return 130
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    from bench.common.table import write_json
    from bench.vision.ttft_report import report
    if args.json:
        write_json(args.json, "vision", {"ttft": results, "notes": __doc__.strip()})
    report(results)
    for where in results["pinning"].get("misplaced_after", []):
        print(f"epd bench vision: pinning did not hold: {where}", file=sys.stderr)
    return 0


def _check(args, sizes: dict) -> tuple[str, tuple | None]:
    """(why the arguments cannot run, or ""; the CPU sets to pin to, or None)."""
    if sizes["rounds"] < 1 or sizes["requests"] < sizes["rounds"]:
        return "--ttft needs --rounds >= 1 and --requests >= --rounds", None
    if args.rate <= 0 or args.max_tokens < 1 or args.vision_workers < 1:
        return "--rate, --max-tokens and --vision-workers must be > 0", None
    if bool(args.vision_cpus) != bool(args.stack_cpus):
        return "--vision-cpus and --stack-cpus go together (the vision pool on one set, the rest on the other)", None
    if not args.vision_cpus:
        return "", None
    from bench.common.cpu_pinning import check_cpu_sets, parse_cpu_list
    try:
        pins = (parse_cpu_list(args.vision_cpus), parse_cpu_list(args.stack_cpus))
    except ValueError as exc:
        return str(exc), None
    error = check_cpu_sets(*pins, frozenset(os.sched_getaffinity(0)))
    return error.replace("--compiler-cpus", "--vision-cpus"), pins


# ---- the stacks -----------------------------------------------------------------------------------
def policy_topology(text: str, policy: str, args) -> str:
    """The topology text for one policy's stack."""
    from bench.common.topology_edit import with_model, with_service_settings
    kinds = {s.get("kind") for s in tomllib.loads(text).get("service", [])}
    missing = [k for k in (*VISION_KINDS, "gateway") if k not in kinds]
    if missing:
        raise ValueError(f"the topology has no {', '.join(missing)}: nothing to balance images on")
    text = with_service_settings(text, "vision_balancer", {"policy": policy, "seed": args.seed})
    text = with_service_settings(text, "vision_worker", {"device": args.device,
                                                         "torch_threads": args.torch_threads,
                                                         "max_batch_patches": args.max_batch_patches},
                                 replicas=args.vision_workers)
    for kind in ENGINE_KINDS:
        if kind in kinds:
            text = with_service_settings(text, kind, {"device": args.device})
    return with_model(text, {"dtype": args.dtype})   # the rows' dtype is the engines': one model over the stack


def _stacks(args, model_dir: Path, workdir: Path) -> dict:
    from bench.common.local_stack import LocalStack, topology_text
    source = topology_text(args.topology or "default")
    stacks = {}
    workdir.mkdir(parents=True, exist_ok=True)
    for policy in args.policies:
        path = workdir / f"topology-{policy}.toml"
        path.write_text(policy_topology(source, policy, args))
        stacks[policy] = LocalStack(str(path), model_dir, workdir / policy)
    return stacks


def _state(stack) -> dict:
    return json.loads((stack.run_dir / "state.json").read_text())


def _logs(stack, kinds) -> list[Path]:
    return [stack.run_dir / "logs" / f"{s['instance']}.log" for s in _state(stack)["services"] if s["kind"] in kinds]


# ---- the requests ---------------------------------------------------------------------------------
def chat_body(model: str, images, max_tokens: int) -> bytes:
    """A streaming Chat Completion of the request's images (JPEG data URLs), then QUESTION."""
    content = [{"type": "image_url",
                "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(image.data).decode()}}
               for image in images]
    content.append({"type": "text", "text": QUESTION})
    return json.dumps({"model": model, "messages": [{"role": "user", "content": content}],
                       "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}, "thinking": {"type": "disabled"}}).encode()


def window_requests(trace, images, model: str, max_tokens: int, round_: int, label: str) -> list:
    """One window's requests, offsets from its first arrival (grammar_ttft_plain's PlainRequest)."""
    from bench.common.plain_traffic import PlainRequest
    from bench.stack.workload import BenchRequest
    origin = trace[0].arrival_s
    return [PlainRequest(round_, i, request.arrival_s - origin,
                         BenchRequest(label, round_, i, chat_body(model, images[i], max_tokens), None))
            for i, request in enumerate(trace)]


def build_trace(args, sizes: dict, model_dir: Path):
    """(warm-up trace and images, measured trace and images): one seeded draw, warm-up first."""
    from messages.images import VisionSizing
    from bench.vision.real import trace_images
    from bench.vision.trace import mixed_trace
    sizing = VisionSizing.from_config(json.loads((model_dir / "config.json").read_text()))
    warm = WARMUP_REQUESTS[args.quick]
    trace = mixed_trace(warm + sizes["requests"], args.rate, sizing, seed=args.seed)
    images = trace_images(trace, sizing, args.seed)
    return (trace[:warm], images[:warm]), (trace[warm:], images[warm:])


# ---- the run --------------------------------------------------------------------------------------
def measure(args, sizes: dict, model_dir: Path, workdir: Path, pins) -> dict:
    from bench.common.plain_traffic import run_window, split
    from bench.common.table import machine
    from bench.vision.trace import spread
    from bench.vision.ttft_logs import count_events, read_worker_logs
    from bench.vision.ttft_report import Window, summarize
    policies = list(args.policies)
    _progress(f"drawing the trace: {sizes['requests']} requests at {args.rate:g}/s, seed {args.seed}")
    (warm_trace, warm_images), (trace, images) = build_trace(args, sizes, model_dir)
    stacks = _stacks(args, model_dir, workdir)
    model = next(iter(stacks.values())).gateway_settings().get("served_model", "deepseek-v41-tiny")
    per_round = split(len(trace), sizes["rounds"])
    bounds = [sum(per_round[:r]) for r in range(len(per_round) + 1)]
    load_before, host = os.getloadavg()[0], machine()   # before pinning narrows this process's CPUs
    windows: list[Window] = []
    with contextlib.ExitStack() as running:
        for policy, stack in stacks.items():   # one at a time: each picks its free ports as it starts
            _progress(f"starting the {policy} stack ({args.vision_workers} vision workers, HTTP {stack.url})")
            running.enter_context(stack)
        pinning, plan = _pin([_state(s) for s in stacks.values()], pins)
        for policy, stack in stacks.items():
            _progress(f"warming the {policy} stack ({len(warm_trace)} request(s))")
            run_window(stack.url, "warmup", window_requests(warm_trace, warm_images, model, args.max_tokens, 0,
                                                            "warmup"))
        for round_ in range(sizes["rounds"]):
            part = slice(bounds[round_], bounds[round_ + 1])
            requests = window_requests(trace[part], images[part], model, args.max_tokens, round_, "vision")
            for policy in policies[round_ % len(policies):] + policies[:round_ % len(policies)]:
                _progress(f"round {round_ + 1}/{sizes['rounds']}: {policy} ({len(requests)} requests)")
                started = time.time()
                outcomes, wall = run_window(stacks[policy].url, policy, requests)
                windows.append(Window(policy, round_, outcomes, wall, started, time.time()))
        if plan is not None:   # a thread started off its CPUs during the run would show here
            from bench.common.cpu_pinning import misplaced
            pinning["misplaced_after"] = misplaced(plan)[:20]
        _progress("done; stopping the stacks (epd down)")
    logs = {p: read_worker_logs(_logs(s, ("vision_worker",))) for p, s in stacks.items()}
    retries = {p: count_events(_logs(s, ENGINE_KINDS), "vision.retry") for p, s in stacks.items()}
    low, high = spread(trace)
    return {"topology": args.topology or "default", "policies": policies, "sizes": sizes, "rate_per_s": args.rate,
            "seed": args.seed, "max_tokens": args.max_tokens, "vision_workers": args.vision_workers,
            "device": args.device, "dtype": args.dtype, "torch_threads": args.torch_threads,
            "patches_range": [low, high], "images": sum(len(r.images) for r in trace),
            "warmup_requests": len(warm_trace), "pinning": pinning, "cpus": host["cores"],
            "cpus_usable": host["cores_usable"], "load_avg_1m": [round(load_before, 2),
                                                                 round(os.getloadavg()[0], 2)],
            **summarize(windows, logs, retries, policies)}


def _pin(states: list[dict], pins):
    """(what was pinned, for the report; the plan, to check again after the run). Each vision worker
    gets its own slice of the vision CPUs when there are enough (a card of its own), the balancers
    all of them; the same worker of every stack the same slice (one stack runs at a time)."""
    if pins is None:
        return {"mode": "none"}, None
    from bench.common.cpu_pinning import PinPlan, apply, children_of, format_cpu_list, tree
    vision_cpus, stack_cpus = pins
    children = children_of()
    groups: dict[str, tuple[frozenset[int], list[int]]] = {"stack": (stack_cpus, [os.getpid()])}
    for state in states:
        groups["stack"][1].append(state["supervisor_pid"])
        workers = sorted(s["instance"] for s in state["services"] if s["kind"] == "vision_worker")
        slices = dict(zip(workers, cpu_slices(vision_cpus, len(workers))))
        for service in state["services"]:
            if not service.get("pid"):
                continue
            name, cpus = {"vision_worker": (service["instance"], slices.get(service["instance"])),
                          "vision_balancer": ("vision_balancer", vision_cpus)}.get(service["kind"],
                                                                                  ("stack", stack_cpus))
            groups.setdefault(name, (cpus, []))[1].extend(tree(service["pid"], children))
    plan = PinPlan(groups)
    threads = apply(plan)
    return {"mode": "pinned", "vision_cpus": format_cpu_list(vision_cpus), "stack_cpus": format_cpu_list(stack_cpus),
            "groups": {name: format_cpu_list(cpus) for name, (cpus, _) in groups.items()},
            "processes": {name: len(pids) for name, (_, pids) in groups.items()}, "threads": threads}, plan


def cpu_slices(cpus: frozenset[int], workers: int) -> list[frozenset[int]]:
    """`workers` disjoint equal slices of `cpus` (the rest unused by workers); all of `cpus` for
    each when there are fewer CPUs than workers."""
    ordered = sorted(cpus)
    size = len(ordered) // workers if workers else 0
    if size == 0:
        return [frozenset(cpus)] * workers
    return [frozenset(ordered[i * size:(i + 1) * size]) for i in range(workers)]


def _progress(what: str) -> None:
    print(f"epd bench vision: [{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)
