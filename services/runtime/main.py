"""Process entry for one service: `epd serve KIND` (or `python -m services.runtime.main`).

Config comes from EPD_* environment variables (what `epd up` and Compose set), then flags.
"""
from __future__ import annotations

import argparse
import os
import sys

import uvloop

from services.runtime.config import ServiceConfig
from services.runtime.logs import configure_logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kind", nargs="?", help="service kind (see services/catalog.py) or module:Class")
    parser.add_argument("--instance")
    parser.add_argument("--bind")
    parser.add_argument("--advertise")
    parser.add_argument("--upstream")
    parser.add_argument("--metrics-bind")


def serve(args: argparse.Namespace) -> int:
    from services.catalog import resolve
    try:
        config = ServiceConfig.from_env(kind=args.kind, instance=args.instance, bind=args.bind,
                                        advertise=args.advertise, upstream=args.upstream,
                                        metrics_bind=args.metrics_bind)
        service_cls = resolve(config.kind)
    except ValueError as exc:
        print(f"epd serve: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level)
    service = service_cls(config)
    code = uvloop.run(service.run())   # returns once the service closed what it owns (sockets flushed, pools joined)
    if code:   # a plain line for whoever reads stderr (the supervisor quotes it as the reason)
        print(f"epd serve: {config.instance} ({config.kind}) exits {code}: {service.failure}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    # At once, without the interpreter's teardown: after a failed start a thread left behind (an
    # engine's) must not keep the process alive, and after a clean stop tearing down torch's modules
    # only costs a worker ~1 s, which `epd down` (one tier after another) and every restart would wait.
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="epd serve")
    add_arguments(parser)
    return serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
