"""`epd bench grammar --ttft`: TTFT of plain requests while heavy grammars compile, against the same
requests with no grammar traffic, on one local stack.

  stack     the topology (default: the default E/P/D stack, with its grammar compiler) started as
            real processes in a private working directory (bench/common/local_stack.py, as `epd bench stack`
            does; `epd down` at the end, always). `--compile-processes` sets the compiler's processes.
  plain     `--requests` streaming chat requests per side at `--rate` per second (bench/common/plain_traffic.py).
  grammar   loaded windows only: `--compiles` GrammarCompile requests kept in flight straight at the
            compiler replicas (addresses from the run's state.json), each a cold compile of
            `--grammar-properties` salted properties (ttft_load.py).
  windows   `--rounds` rounds of one baseline and one loaded window, the same requests in both,
            which side opens a round alternating; a window ends when its last plain request has,
            and a loaded one then waits for its compiles in flight. One unmeasured warm-up window
            (a few requests under load) comes first.
  pinning   `--compiler-cpus` / `--stack-cpus` (CPU lists): the compiler and its compile processes
            on the first, every other service, the supervisor and this client on the second
            (bench/common/cpu_pinning.py), standing in for compilers on machines of their own. Without
            them everything shares every CPU, so on a small box the loaded side is slower by
            construction: the compiles take cores the stack needs.
Target: loaded p99 TTFT / baseline p99 TTFT < 1.05.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TTFT_FULL = {"requests": 60, "rounds": 3}
TTFT_QUICK = {"requests": 4, "rounds": 1}
WARMUP_REQUESTS = {False: 3, True: 1}      # --quick: one; unmeasured, under the compile load


def run_ttft(args) -> int:
    from bench.common.cpu_pinning import check_cpu_sets, parse_cpu_list
    from bench.stack.command import _model_dir
    from bench.common.local_stack import default_topology
    from services.runtime.logs import configure_logging
    sizes = {k: v if getattr(args, k, None) is None else getattr(args, k)
             for k, v in (TTFT_QUICK if args.quick else TTFT_FULL).items()}
    error = _check(args, sizes)
    pins = None
    if not error and (args.compiler_cpus or args.stack_cpus):
        try:
            pins = (parse_cpu_list(args.compiler_cpus), parse_cpu_list(args.stack_cpus))
            error = check_cpu_sets(*pins, frozenset(os.sched_getaffinity(0)))
        except ValueError as exc:
            error = str(exc)
    model_dir = None if error else _model_dir(args.model_dir)
    if not error and model_dir is None:
        error = f"no model at {args.model_dir} (make one with `epd model init`)"
    if error:
        print(f"epd bench grammar: {error}", file=sys.stderr)
        return 2
    configure_logging("warning")
    topology = args.topology or default_topology()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="epd-bench-grammar-ttft-"))
    keep = bool(args.workdir)
    try:
        stack = _local_stack(topology, model_dir, workdir, args.compile_processes)
        results = measure(args, sizes, stack, topology, pins)
    except (RuntimeError, ValueError, OSError, subprocess.SubprocessError) as exc:
        started = (workdir / "runs").exists()
        keep = keep or started
        logs = f"\n  (the stack's logs are kept in {workdir / 'runs'})" if started else ""
        print(f"epd bench grammar: {exc}{logs}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("epd bench grammar: interrupted; the stack is stopped", file=sys.stderr)
        return 130
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    from bench.grammar.ttft_report import report
    from bench.common.table import write_json
    if args.json:
        write_json(args.json, "grammar", {"model_dir": str(model_dir), "ttft_under_compile": results,
                                          "notes": __doc__.strip()})
    report(results, header(results))
    for where in results["pinning"].get("misplaced_after", []):
        print(f"epd bench grammar: pinning did not hold: {where}", file=sys.stderr)
    return 0


def _check(args, sizes: dict) -> str:
    if sizes["rounds"] < 1 or sizes["requests"] < sizes["rounds"]:
        return "--ttft needs --rounds >= 1 and --requests >= --rounds"
    if args.rate <= 0 or args.max_tokens < 1 or args.grammar_properties < 1:
        return "--rate, --max-tokens and --grammar-properties must be > 0"
    if args.compiles is not None and args.compiles < 0:
        return "--compiles must be >= 0"
    if args.compile_processes is not None and args.compile_processes < 1:
        return "--compile-processes must be >= 1"
    if bool(args.compiler_cpus) != bool(args.stack_cpus):
        return "--compiler-cpus and --stack-cpus go together (the compiler on one set, the rest on the other)"
    return ""


def _local_stack(topology: str, model_dir: Path, workdir: Path, compile_processes: int | None):
    from bench.common.local_stack import LocalStack, topology_text
    if compile_processes is not None:
        workdir.mkdir(parents=True, exist_ok=True)
        source = workdir / "topology-source.toml"
        source.write_text(with_compile_processes(topology_text(topology), compile_processes))
        topology = str(source)
    return LocalStack(topology, model_dir, workdir)


def with_compile_processes(text: str, processes: int) -> str:
    """The topology text with `processes = N` in every grammar compiler's settings (added or replaced)."""
    from bench.common.topology_edit import with_service_settings
    return with_service_settings(text, "grammar_compiler", {"processes": processes})


def compile_processes(stack) -> int:
    """Compile processes over every compiler replica, as the topology configures them."""
    return sum(s.replicas * _compiler_setting(s, "processes") for s in stack.topology.services
               if s.kind == "grammar_compiler")


def _compiler_setting(spec, name: str):
    """A grammar compiler's setting: the topology's value, else the service's default."""
    import dataclasses
    from services.grammar_compiler.service import GrammarCompilerSettings
    defaults = {f.name: f.default for f in dataclasses.fields(GrammarCompilerSettings)}
    return spec.options.get("settings", {}).get(name, defaults[name])


def compiler_tokenizer(stack) -> Path:
    spec = next(s for s in stack.topology.services if s.kind == "grammar_compiler")
    return stack.workdir / spec.options["settings"]["model_dir"] / "tokenizer.json"


# ---- the run ------------------------------------------------------------------------------------
def measure(args, sizes: dict, stack, topology: str, pins) -> dict:
    from messages.grammar import tokenizer_id
    from bench.grammar.ttft_load import CompileLoad
    from bench.common.plain_traffic import plain_requests, split
    from bench.grammar.ttft_report import summarize, window_order
    from bench.stack.workload import Workload
    from bench.common.table import machine
    processes = compile_processes(stack)
    if processes == 0:
        raise ValueError(f"topology {topology} has no grammar_compiler service")
    in_flight = processes if args.compiles is None else args.compiles
    per_round = split(sizes["requests"], sizes["rounds"])
    _progress(f"building {sizes['requests']} plain requests per side with the gateway's adapter")
    workload = Workload(stack.gateway_settings(), stack.workdir)
    rounds = plain_requests(workload, per_round, args.rate, args.max_tokens, args.seed)
    warmup = plain_requests(workload, [WARMUP_REQUESTS[args.quick]], args.rate, args.max_tokens, args.seed + 1,
                            "warmup")[0]
    load_before = os.getloadavg()[0]
    host = machine()   # before pinning narrows this process's CPUs
    _progress(f"starting the stack (topology {topology}, ports {stack.port_base}+, HTTP {stack.url})")
    with stack:
        state = json.loads((stack.run_dir / "state.json").read_text())
        compilers = [s["address"] for s in state["services"] if s["kind"] == "grammar_compiler"]
        pinning, plan = _pin(state, pins)
        load = CompileLoad(compilers, tokenizer_id(str(compiler_tokenizer(stack))), args.grammar_properties,
                           in_flight, _compile_timeout(stack))
        _progress(f"stack ready; warming up ({len(warmup)} request(s), {in_flight} compile(s) in flight)")
        _run_window(stack, load, "loaded", warmup, in_flight)
        windows = []
        for round_, side in window_order(len(rounds)):
            _progress(f"round {round_ + 1}/{len(rounds)}: {side} ({len(rounds[round_])} requests)")
            windows.append(_run_window(stack, load, side, rounds[round_], in_flight))
        if plan is not None:   # a thread started off its CPUs during the run would show here
            from bench.common.cpu_pinning import misplaced
            pinning["misplaced_after"] = misplaced(plan)[:20]
        _progress("done; stopping the stack (epd down)")
    return {"topology": topology, "topology_file": str(stack.topology.source), "sizes": sizes, "rate_per_s": args.rate,
            "max_tokens": args.max_tokens, "seed": args.seed, "grammar_properties": args.grammar_properties,
            "compiles_in_flight": in_flight, "compile_processes": processes, "compilers": compilers,
            "pinning": pinning, "cpus": host["cores"], "cpus_usable": host["cores_usable"],
            "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)], **summarize(windows)}


def _run_window(stack, load, side: str, requests, in_flight: int):
    """One window: the plain requests at their times, under the compile load on the loaded side."""
    from bench.common.plain_traffic import run_window
    from bench.grammar.ttft_report import Window
    loaded = side == "loaded" and in_flight > 0
    if loaded:
        load.start()
    try:
        outcomes, wall = run_window(stack.url, side, requests)
    finally:
        window = load.stop() if loaded else None
    return Window(side, requests[0].round, outcomes, wall, window)


def _pin(state: dict, pins):
    """(what was pinned, for the report; the plan, to check again after the run)."""
    if pins is None:
        return {"mode": "none"}, None
    from bench.common.cpu_pinning import apply, format_cpu_list, plan_for_stack
    plan = plan_for_stack(state, *pins, own_pid=os.getpid())
    threads = apply(plan)
    return {"mode": "pinned", "compiler_cpus": format_cpu_list(pins[0]), "stack_cpus": format_cpu_list(pins[1]),
            "processes": {name: len(pids) for name, (_, pids) in plan.groups.items()}, "threads": threads}, plan


def _compile_timeout(stack) -> float:
    spec = next(s for s in stack.topology.services if s.kind == "grammar_compiler")
    return float(_compiler_setting(spec, "compile_timeout_s"))


def header(results: dict) -> str:
    pin = results["pinning"]
    if pin["mode"] == "pinned":
        procs = pin["processes"]
        pinning = (f"pinned: compiler on CPUs {pin['compiler_cpus']} ({procs['compiler']} processes), everything "
                   f"else on {pin['stack_cpus']} ({procs['stack']} processes: services, supervisor, this client)")
    else:
        pinning = "no pinning (the compiler, the stack and this client share every CPU)"
    sizes = results["sizes"]
    return (f"epd bench grammar --ttft: host {results['cpus']} CPUs ({results['cpus_usable']} usable), {pinning}; "
            f"topology {results['topology']}; {sizes['requests']} plain requests per side in {sizes['rounds']} "
            f"round(s) at {results['rate_per_s']:g}/s, {results['max_tokens']} tokens out, thinking off; loaded: "
            f"{results['compiles_in_flight']} compiles in flight on {results['compile_processes']} compile "
            f"process(es), {results['grammar_properties']:,} salted properties each; load "
            f"{results['load_avg_1m'][0]:g}->{results['load_avg_1m'][1]:g}")


def _progress(what: str) -> None:
    print(f"epd bench grammar: [{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)
