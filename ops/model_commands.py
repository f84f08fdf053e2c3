"""`epd model ...`: model directory tools (`model init` writes a seeded random-weight model)."""

from __future__ import annotations

import argparse

DEFAULT_CONFIGS = {"v4": "tiny", "v4.1": "tiny-v41"}


def register(subparsers) -> None:
    model = subparsers.add_parser("model", help="model directory tools")
    commands = model.add_subparsers(dest="model_command", required=True, metavar="SUBCOMMAND")
    init = commands.add_parser("init", help="write a seeded random-weight model directory (HF layout)")
    init.add_argument("--arch", default="v4", choices=tuple(DEFAULT_CONFIGS),
                      help="v4: transformers' DeepseekV4 layout; v4.1: the released V4.1 format (FP8/MXFP4)")
    init.add_argument("--config", default=None,
                      help="bundled config name (v4: tiny, bench8; v4.1: tiny-v41) or a config.json path; "
                           "default tiny / tiny-v41")
    init.add_argument("--out", required=True, help="directory to write config.json, model*.safetensors, tokenizer.json")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--vocab-size", type=int, default=None, help="default: the real 129,280-token vocabulary")
    init.add_argument("--dtype", default=None, choices=("bfloat16", "float32", "float16"),
                      help="v4 only (default bfloat16); v4.1 stores what the release stores")
    init.set_defaults(func=cmd_init)


def cmd_init(args: argparse.Namespace) -> int:
    config = args.config or DEFAULT_CONFIGS[args.arch]
    if args.arch == "v4.1":
        if args.dtype is not None:
            raise SystemExit("epd model init: --dtype applies to --arch v4 only (v4.1 writes the released formats)")
        from engine.models.v41.random_init import write_random_v41_model_dir

        out = write_random_v41_model_dir(config, args.out, seed=args.seed, vocab_size=args.vocab_size)
    else:
        from engine.models.v4.random_init import write_random_model_dir

        out = write_random_model_dir(config, args.out, seed=args.seed, vocab_size=args.vocab_size,
                                     dtype=args.dtype or "bfloat16")
    print(f"wrote {out} ({args.arch}, config {config}, seed {args.seed})")
    return 0
