"""The `epd trace` command: where the logs come from (files, run directories, stdin), then the
timeline (timeline.py) and, with --chrome, the trace-event JSON (chrome.py)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Iterator

from ops.trace.timeline import TraceSourceError, read_trace, render
from ops.trace.chrome import chrome_trace


def resolve_sources(sources: list[str], run_dir: str | None) -> list[str | Path]:
    """Paths of the log files to read ("-" is stdin); a directory means its logs/*.log or *.log."""
    names = list(sources) + ([run_dir] if run_dir else [])
    if not names:
        from ops.stack_commands import current_run_dir
        current = current_run_dir()
        if not current.exists():
            raise TraceSourceError(f"no sources given and no current run at {current} "
                                   "(name log files, a run directory, or - for stdin)")
        names = [str(current)]
    paths: list[str | Path] = []
    for name in names:
        if name == "-":
            paths.append("-")
            continue
        path = Path(name)
        if path.is_dir():
            logs = path / "logs" if (path / "logs").is_dir() else path
            found = sorted(logs.glob("*.log"))
            if not found:
                raise TraceSourceError(f"no *.log files in {logs}")
            paths.extend(found)
        elif path.is_file():
            paths.append(path)
        else:
            raise TraceSourceError(f"{name}: no such file or directory")
    return paths


def iter_lines(paths: list[str | Path], stdin=None) -> Iterator[str]:
    for path in paths:
        if path == "-":
            yield from stdin or sys.stdin
            continue
        try:
            with open(path, encoding="utf-8", errors="replace") as handle:
                yield from handle
        except OSError as exc:
            raise TraceSourceError(f"{path}: {exc.strerror or exc}") from None


def run(args) -> int:
    try:
        trace = read_trace(iter_lines(resolve_sources(args.sources, args.run_dir)), args.request_id)
    except TraceSourceError as exc:
        print(f"epd trace: {exc}", file=sys.stderr)
        return 2
    if not trace.records:
        print(f"no log line matches request {args.request_id!r} (read {trace.lines_read} lines, "
              f"{trace.lines_skipped} of them not JSON log records)")
        return 1
    print(render(trace))
    if args.chrome:
        try:
            Path(args.chrome).write_text(json.dumps(chrome_trace(trace), default=str))
        except OSError as exc:
            print(f"epd trace: cannot write {args.chrome}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        print(f"\nwrote {args.chrome}: open it at https://ui.perfetto.dev")
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("trace", help="show one request's path across services, from the logs")
    parser.add_argument("request_id", metavar="REQUEST_ID", help="a request id (or trace id)")
    # default=[]: without a default, argparse counts a "*" positional as required and names it in
    # the usage error ("required: REQUEST_ID, SOURCE") although no SOURCE is needed
    parser.add_argument("sources", nargs="*", metavar="SOURCE", default=[],
                        help="log files, run directories, or - for stdin (docker compose logs); "
                             "default: the current run (.epd/runs/current, or $EPD_RUN_ROOT/current)")
    parser.add_argument("--run-dir", help="a run directory whose logs/*.log to read")
    parser.add_argument("--chrome", metavar="FILE", help="also write Chrome/Perfetto trace-event JSON here")
    parser.set_defaults(func=run)
