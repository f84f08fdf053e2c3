"""The `epd` command. Each subcommand lives in its own module with a `register(subparsers)`."""
from __future__ import annotations

import argparse
import importlib
import sys

# module -> registers these subcommands; imported on start, each keeps heavy imports inside its handlers
COMMAND_MODULES = (
    "ops.serve_command",     # serve
    "ops.stack_commands",    # up, down, status, health
    "ops.trace.command",     # trace
    "ops.tap",               # tap
    "ops.keys_command",      # keys
    "ops.compose.command",   # compose
    "ops.kube.command",      # kube
    "bench",                 # bench ...
    "ops.model_commands",    # model init
    "ops.replay_command",    # replay-check
    "ops.chaos.command",     # chaos
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epd", description="epd: disaggregated serving for DeepSeek V4 and V4.1")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
