"""`epd model ...`: model directory tools (`model init` writes a seeded random-weight model)."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    model = subparsers.add_parser("model", help="model directory tools")
    commands = model.add_subparsers(dest="model_command", required=True, metavar="SUBCOMMAND")
    init = commands.add_parser("init", help="write a seeded random-weight model directory (HF layout)")
    init.add_argument("--config", default="tiny", help="bundled config name (tiny, bench8) or a config.json path")
    init.add_argument("--out", required=True, help="directory to write config.json, model.safetensors, tokenizer.json")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--vocab-size", type=int, default=None, help="default: the real 129,280-token vocabulary")
    init.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    init.set_defaults(func=cmd_init)


def cmd_init(args: argparse.Namespace) -> int:
    from engine.model.random_init import write_random_model_dir

    out = write_random_model_dir(args.config, args.out, seed=args.seed, vocab_size=args.vocab_size, dtype=args.dtype)
    print(f"wrote {out} (config {args.config}, seed {args.seed})")
    return 0
