"""`epd replay-check`: DeepInfer's two-level equivalence check of bounded replay (V4.1 models).

Level 1 (metadata) must hold exactly; level 2 prints how far replay's teacher-forced log-probs are
from a full recompute, against the pass marks in engine.models.v41.replay_check.THRESHOLDS. Replay is
trimmed as the engine runs it (T = max(H - 128, L - 128): the upper layers' first row); level 2
compares the rows with logits, and shows replay without trim and no replay on the same rows.
"""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser("replay-check", help="bounded replay vs full recompute: metadata, then logprobs")
    p.add_argument("--model", default=".epd/models/deepseek-v41-tiny", help="a V4.1 model directory")
    p.add_argument("--prompts", type=int, default=12, help="seeded prompts (hits of 2-4 blocks)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default=None, choices=(None, "bfloat16", "float32"), help="default: the model's")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.set_defaults(func=cmd_replay_check)


def cmd_replay_check(args: argparse.Namespace) -> int:
    import torch

    from engine.loading import load_model, model_arch
    from engine.models.v41.replay_check import THRESHOLDS, Agreement, check_prompt, sample_prompts

    if model_arch(args.model) != "v4.1":
        print(f"{args.model} is not a V4.1 model: bounded replay is a V4.1 mechanism")
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, "cpu", args.dtype)
    checks = [check_prompt(model, prompt, hit) for prompt, hit in sample_prompts(args.prompts, args.seed)]
    print(f"bounded replay vs full recompute: {args.model} ({model.dtype}), {len(checks)} prompts, seed {args.seed}")
    print("\nlevel 1 (metadata)")
    names = list(checks[0].metadata)
    level1 = True
    for name in names:
        held = sum(c.metadata[name] for c in checks)
        level1 &= held == len(checks)
        print(f"  {'ok  ' if held == len(checks) else 'FAIL'} {name:54s} {held}/{len(checks)}")
    print("\nlevel 2 (teacher-forced logprobs)")
    header = f"{'n':>5s} {'mean|d|':>9s} {'max|d|':>9s} {'top-1':>7s} {'top-5':>7s}"
    print(f"  {'rows (T = max(H-128, L-128))':34s} {header}")
    replayed = Agreement.pooled([c.replayed for c in checks])
    after = Agreement.pooled([c.after for c in checks])
    untrimmed = Agreement.pooled([c.untrimmed for c in checks])
    no_replay = Agreement.pooled([c.no_replay for c in checks])
    for label, a in (("replayed [T, H)", replayed), ("after the hit [max(H, T), L-1)", after),
                     ("  replay without trim, same rows", untrimmed), ("  no replay, same rows", no_replay)):
        print(f"  {label:34s} {a.rows:5d} {a.mean_abs:9.4f} {a.max_abs:9.4f} {a.top1:7.3f} {a.top5:7.3f}")
    ratio = after.mean_abs / no_replay.mean_abs if no_replay.mean_abs else 0.0
    print(f"  after the hit, replay / no replay mean|d|: {ratio:.3f} "
          f"(pass: <= {THRESHOLDS['mean_abs_vs_no_replay']}, and top-1 not below no replay's)")
    level2 = after.passes_against(no_replay)
    print(f"\nlevel 1 {'PASS' if level1 else 'FAIL'}; level 2 {'PASS' if level2 else 'FAIL'}")
    return 0 if level1 and level2 else 1
