"""`epd serve KIND`: run one service in this process (what `epd up` and Compose start)."""
from __future__ import annotations

from services.runtime import main as service_main


def register(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="run one service (config from EPD_* variables and flags)")
    service_main.add_arguments(parser)
    parser.set_defaults(func=service_main.serve)
