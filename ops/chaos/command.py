"""`epd chaos`: run fault scenarios against a stack and print what every request saw.

Without --run-dir/--url it starts its own stack: the default topology with 2 prefill and 2 decode
workers, in a working directory of its own (fresh KV store, free ports), stopped at the end. With
them it attaches to a running stack (the drain scenario then stops that stack: it runs last).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import shutil
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_MODEL = ".epd/models/deepseek-v41-tiny"
SCENARIO_TIMEOUT_S = 900.0      # a scenario past this is cut off and reported, never waited on


def register(subparsers) -> None:
    from ops.chaos.scenarios import SCENARIOS
    parser = subparsers.add_parser("chaos", help="kill, freeze and overload a stack's processes; report every request")
    parser.add_argument("--scenario", action="append", choices=tuple(SCENARIOS), metavar="NAME",
                        help=f"run this scenario (repeatable; default all): {', '.join(SCENARIOS)}")
    parser.add_argument("--run-dir", help="attach to the stack of this run directory instead of starting one")
    parser.add_argument("--url", help="the attached stack's HTTP API (default: its gateway's http_bind)")
    parser.add_argument("--model-dir", default=DEFAULT_MODEL,
                        help=f"the model a started stack serves (default {DEFAULT_MODEL}, made as `make model` does)")
    parser.add_argument("--replicas", type=int, default=2, help="prefill and decode workers of a started stack")
    parser.add_argument("--workdir", help="a started stack's directory (default: a temporary one; kept on failure)")
    parser.add_argument("--keep", action="store_true", help="leave a started stack running at the end")
    parser.add_argument("--chunk-timeout-s", type=float, default=60.0,
                        help="a stream silent this long is given up (an error in the table)")
    parser.add_argument("--recover-s", type=float, default=90.0, help="how long a killed service may take to be back")
    parser.add_argument("--json", metavar="FILE", help="also write the rows (with notes and failed checks) to FILE")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from bench.common.table import machine, write_json
    from ops.chaos.client import Limits
    from ops.chaos.runner import Context
    from ops.chaos.scenarios import SCENARIOS
    from ops.chaos.stack import ChaosStack
    from ops.chaos.table import format_report
    chosen = [name for name in SCENARIOS if name in (args.scenario or SCENARIOS)]
    workdir = None
    try:
        if args.run_dir or args.url:
            from ops.stack_commands import current_run_dir
            stack = ChaosStack.attach(current_run_dir(args.run_dir), args.url)
        else:
            model_dir = _model_dir(args.model_dir)
            workdir = Path(args.workdir or tempfile.mkdtemp(prefix="epd-chaos-"))
            _progress(f"starting the stack ({args.replicas} prefill + {args.replicas} decode workers) in {workdir}")
            stack = ChaosStack.start(workdir, model_dir, args.replicas)
    except (RuntimeError, OSError, ValueError) as exc:
        print(f"epd chaos: {exc}", file=sys.stderr)
        return 1
    ctx = Context(stack, Limits(chunk_timeout_s=args.chunk_timeout_s), recover_s=args.recover_s)
    started = time.monotonic()
    try:
        rows = asyncio.run(run_scenarios(ctx, chosen))
    finally:
        if stack.owned and not args.keep and stack.state().get("status") not in ("stopped", "failed"):
            _progress("stopping the stack (epd down)")
            stack.down()
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    m = machine()
    title = (f"epd chaos: {date}, {m['cpu_model']}, {m['cores_usable']}/{m['cores']} cores, "
             f"stack {stack.run_dir} ({time.monotonic() - started:.0f} s)")
    print(format_report(rows, title))
    if args.json:
        write_json(args.json, "chaos", {"run_dir": str(stack.run_dir), "rows": [r.as_dict() for r in rows]})
    failed = [r.scenario for r in rows if not r.ok]
    if workdir is not None and not failed and not args.workdir and not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    elif workdir is not None:
        print(f"epd chaos: the stack's logs are in {stack.run_dir / 'logs'}", file=sys.stderr)
    return 1 if failed else 0


async def run_scenarios(ctx, names: list[str]) -> list:
    """Each scenario in turn, on a healthy stack; one that raises or overruns is a failed row."""
    from ops.chaos.scenarios import SCENARIOS
    from ops.chaos.table import Row
    rows = []
    for name in names:
        started = time.monotonic()
        healthy = await asyncio.to_thread(ctx.stack.wait_healthy, ctx.recover_s)
        ctx.progress(f"{name}" + ("" if healthy else f" (the stack is not healthy: {ctx.stack.not_ready()})"))
        try:
            got = await asyncio.wait_for(SCENARIOS[name](ctx), SCENARIO_TIMEOUT_S)
        except asyncio.TimeoutError:
            got = [Row(name, failures=[f"the scenario did not finish within {SCENARIO_TIMEOUT_S:g} s"])]
        except Exception as exc:   # a harness or stack failure: reported, the other scenarios still run
            got = [Row(name, failures=[f"the scenario raised {type(exc).__name__}: {exc}"])]
        for row in got:
            row.seconds = row.seconds or time.monotonic() - started
            if not healthy:
                row.notes.insert(0, "the stack was not healthy when this scenario began")
        rows += got
    return rows


def _model_dir(path: str) -> Path:
    """The model directory; the default one is made as `make model` makes it when missing."""
    model_dir = Path(path)
    if not (model_dir / "config.json").exists():
        if path != DEFAULT_MODEL:
            raise ValueError(f"no model at {path} (make one with `epd model init --arch v4.1`)")
        from engine.models.v41.random_init import write_random_v41_model_dir
        _progress(f"writing the tiny model to {model_dir} (epd model init --arch v4.1 --seed 0)")
        write_random_v41_model_dir("tiny-v41", model_dir, seed=0)
    return model_dir


def _progress(what: str) -> None:
    print(f"epd chaos: [{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)
