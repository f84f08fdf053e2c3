"""`epd bench grammar`: structured output, llguidance (ours) against xgrammar, and what masks cost the engine.

One run, one tokenizer (the model directory's tokenizer.json, 129,280 tokens for DeepSeek V4/V4.1):

  compile  per schema class (cases.py: simple, nested, 1,000-value enum, 20 strict tools,
           two pathological schemas), cold: every compile runs in a freshly forked process holding
           only the library's tokenizer, with the compiler service's hard limit (`--timeout-s`) and a
           memory cap (compile.py). p50 / max over `--runs` compiles (pathological: one).
             llguidance  services/grammar_compiler/check.py's compile job: build_grammar + check (a
                         matcher built, the first mask computed); artifact = the grammar text.
             xgrammar    services/grammar_compiler/xgrammar_backend.py: a cache-free GrammarCompiler
                         on `--xgrammar-threads` threads; artifact = the serialized CompiledGrammar;
                         tool calls through its DeepSeek V4.1 structural tag.
  masks    per class and library, a random walk of `--tokens` tokens through the grammar just
           compiled (masks.py): p50 / p99 / max of one mask fill on the whole vocabulary.
  engine   EngineCore on the tiny model, B (`--batches`) requests decoding under one json_schema
           (`--engine-case`) against the same batch unconstrained, sides taking turns
           (bench/engine/command.py): ms per step and masked / plain.
  ttft     `--ttft`, a run of its own (the three parts above are skipped): TTFT of plain streaming
           requests while heavy grammars compile, against the same requests with no grammar
           traffic, on a local stack started for the run (ttft.py: sides taking turns,
           optional CPU pinning of the compiler apart from the rest); its own tables, and
           `ttft_under_compile` in the JSON. Target: loaded p99 / baseline p99 < 1.05.

Ratios are xgrammar / llguidance for compile and masks (above 1: xgrammar slower or larger), and
masked / plain for the engine, each against a baseline measured in the same run. xgrammar is not a
dependency: without it its rows say "xgrammar not installed".
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from bench.common.table import print_table, write_json

DEFAULT_MODEL_DIR = ".epd/models/deepseek-v41-tiny"   # the default stack's model (`make model`)
QUICK = {"runs": 1, "tokens": 10, "steps": 2, "rounds": 1, "regex_copies": 2, "optional_count": 20}
FULL = {"runs": 3, "tokens": 100, "steps": 5, "rounds": 3, "regex_copies": 20, "optional_count": 2000}


def register(subparsers) -> None:
    parser = subparsers.add_parser("grammar", help="structured output: llguidance vs xgrammar compile and "
                                                   "mask times, engine steps with masks vs without; --ttft: plain TTFT "
                                                   "while heavy grammars compile")
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", default=DEFAULT_MODEL_DIR,
                        help=f"model directory: its tokenizer.json and, for the engine part, the model "
                             f"(default {DEFAULT_MODEL_DIR})")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run in seconds: one compile, short walks and windows, the "
                             "pathological schemas shrunk until they are not")
    parser.add_argument("--json", metavar="FILE", help="also write every number to FILE")
    parser.add_argument("--runs", type=int, help=f"cold compiles per class (default {FULL['runs']}; "
                                                 "pathological classes: 1)")
    parser.add_argument("--tokens", type=int, help=f"random-walk length for mask times (default {FULL['tokens']})")
    parser.add_argument("--batches", type=_int_list, default=(1, 8), help="engine batch sizes (default 1,8)")
    parser.add_argument("--steps", type=int, help=f"timed engine steps per window (default {FULL['steps']})")
    parser.add_argument("--rounds", type=int, help=f"engine rounds, plain and masked taking turns "
                                                   f"(default {FULL['rounds']}); with --ttft: rounds of one "
                                                   f"baseline and one loaded window (default 3)")
    parser.add_argument("--engine-case", default="nested", help="the json_schema class the engine's "
                                                                "requests are held to (default nested)")
    parser.add_argument("--timeout-s", type=float, default=10.0,
                        help="hard limit on one compile, as the compiler service's (default 10)")
    parser.add_argument("--memory-gib", type=float, default=4.0,
                        help="memory one compile process may add before it is killed (default 4)")
    parser.add_argument("--xgrammar-threads", type=int, default=os.cpu_count() or 1,
                        help="xgrammar's compile threads (default: the cores)")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="the engine's torch threads (default 1: on a busy 2-core box more threads "
                             "spin against other processes and steps vary tenfold)")
    parser.add_argument("--seed", type=int, default=0, help="random-walk seed; with --ttft, of the plain "
                                                            "requests (default 0)")
    parser.add_argument("--skip-engine", action="store_true", help="compile and masks only")
    add_ttft_arguments(parser)


def add_ttft_arguments(parser: argparse.ArgumentParser) -> None:
    ttft = parser.add_argument_group("--ttft: plain requests' TTFT while heavy grammars compile, on a local stack")
    ttft.add_argument("--ttft", action="store_true", help="run this part alone (the others are skipped)")
    ttft.add_argument("--requests", type=int, help="plain requests per side (default 60; --quick 4)")
    ttft.add_argument("--rate", type=float, default=2.0, help="plain requests per second, Poisson arrivals "
                                                             "(default 2)")
    ttft.add_argument("--max-tokens", type=int, default=8, help="tokens out per plain request (default 8)")
    ttft.add_argument("--compiles", type=int, help="GrammarCompile requests kept in flight on the loaded side "
                                                   "(default: one per compile process of the stack)")
    ttft.add_argument("--grammar-properties", type=int, default=6000,
                      help="salted required properties of each compiled object (default 6000: ~0.6 s a compile "
                           "on a 2-core box)")
    ttft.add_argument("--compile-processes", type=int,
                      help="the grammar compiler's processes (default: the topology's, 2 in the default stack)")
    ttft.add_argument("--compiler-cpus", metavar="CPUS",
                      help="CPU list (e.g. 8-15) for the grammar compiler and its compile processes; with "
                           "--stack-cpus")
    ttft.add_argument("--stack-cpus", metavar="CPUS",
                      help="CPU list (e.g. 0-7) for every other service, the supervisor and this client")
    ttft.add_argument("--topology", help="topology name or file (default: the default stack)")
    ttft.add_argument("--workdir", help="the stack's working directory (default: a temporary one, removed after)")
    parser.add_argument("--device", default="cpu", help="the engine part's device (default cpu; cuda on a GPU)")
    parser.add_argument("--dtype", default="float32", help="the engine part's dtype (default float32)")


def _int_list(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(",") if v.strip())
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def run(args: argparse.Namespace) -> int:
    if args.ttft:
        from bench.grammar.ttft import run_ttft
        return run_ttft(args)
    from bench.grammar.cases import cases
    sizes = {k: v if getattr(args, k, None) is None else getattr(args, k)
             for k, v in (QUICK if args.quick else FULL).items()}
    model_dir = Path(args.model_dir)
    tokenizer_json = model_dir / "tokenizer.json"
    if not tokenizer_json.exists():
        print(f"epd bench grammar: no tokenizer.json in {model_dir} (make one: epd model init --arch v4.1 "
              f"--seed 0 --out {model_dir})", file=sys.stderr)
        return 2
    if min(sizes["runs"], sizes["tokens"], sizes["steps"], sizes["rounds"]) < 1:
        print("epd bench grammar: --runs, --tokens, --steps and --rounds must be >= 1", file=sys.stderr)
        return 2
    all_cases = cases(sizes["regex_copies"], sizes["optional_count"])
    engine_case = next((c for c in all_cases if c.name == args.engine_case), None)
    if engine_case is None or engine_case.constraint["kind"] != "json_schema":
        names = ", ".join(c.name for c in all_cases if c.constraint["kind"] == "json_schema")
        print(f"epd bench grammar: --engine-case must be one of {names}", file=sys.stderr)
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")   # the compile children are forked
    vocab_size, eos_id = model_vocab(model_dir)
    sides, setup = build_sides(tokenizer_json, vocab_size, eos_id, args.xgrammar_threads)
    doc = {"model_dir": str(model_dir), "vocab_size": vocab_size, "sizes": sizes, "timeout_s": args.timeout_s,
           "memory_gib": args.memory_gib, "xgrammar_threads": args.xgrammar_threads, "setup": setup,
           "load_average_before": list(os.getloadavg())}

    from bench.grammar.compile import measure
    results = []
    for case in all_cases:
        for side in sides:
            runs = 1 if case.pathological else sizes["runs"]
            results.append({"case": case.name, "what": case.what, "library": side.name,
                            **measure(side, case, runs, sizes["tokens"], args.seed, args.timeout_s, args.memory_gib)})
    doc["compile"] = results
    print_compile(results, sizes, args, setup)
    print_masks(results, sizes)

    if not args.skip_engine:
        from bench.grammar.engine import measure_engine
        from services.grammar_compiler.check import compile_constraint
        from messages.grammar import constraint_json
        grammar, _ = compile_constraint(constraint_json(engine_case.constraint), sides[0].tokenizer)
        doc["engine"] = measure_engine(model_dir, sides[0].tokenizer, grammar, list(args.batches), sizes["steps"],
                                       sizes["rounds"], args.torch_threads, args.device, args.dtype)
        print_engine(doc["engine"], engine_case, sizes, args)
    # Part four (TTFT of plain requests while heavy grammars compile) is a run of its own: --ttft.
    doc["load_average_after"] = list(os.getloadavg())
    if args.json:
        write_json(args.json, "grammar", {**doc, "notes": __doc__.strip()})
    return 0


def model_vocab(model_dir: Path) -> tuple[int, int]:
    """(vocab size, EOS id) from config.json: top level (V4) or text_config (V4.1)."""
    raw = json.loads((model_dir / "config.json").read_text())
    text = raw.get("text_config") or {}
    vocab = raw.get("vocab_size") or text.get("vocab_size")
    eos = raw.get("eos_token_id", text.get("eos_token_id", 1))
    return int(vocab), int(eos[0] if isinstance(eos, list) else eos)


def build_sides(tokenizer_json: Path, vocab_size: int, eos_id: int, xgrammar_threads: int):
    """Both libraries with their tokenizers built, and how long each build took."""
    from engine.grammar import load_grammar_tokenizer
    from bench.grammar.compile import LLGuidanceSide, XGrammarSide
    started = time.perf_counter()
    llguidance = LLGuidanceSide(load_grammar_tokenizer(tokenizer_json, vocab_size, eos_id), vocab_size, eos_id)
    setup = {"llguidance_tokenizer_s": round(time.perf_counter() - started, 2)}
    started = time.perf_counter()
    xgrammar = XGrammarSide(tokenizer_json, vocab_size, eos_id, xgrammar_threads)
    if not xgrammar.unavailable:   # the import (torch, transformers) counts: a worker would pay it too
        from services.grammar_compiler.xgrammar_backend import version
        setup.update(xgrammar_tokenizer_s=round(time.perf_counter() - started, 2), xgrammar_version=version())
    import llguidance as llg
    setup["llguidance_version"] = getattr(llg, "__version__", "") or _dist_version("llguidance")
    return [llguidance, xgrammar], setup


def print_compile(results: list[dict], sizes: dict, args, setup: dict) -> None:
    base = {r["case"]: r for r in results if r["library"] == "llguidance"}
    rows = []
    for r in results:
        ref = base[r["case"]] if r["library"] != "llguidance" else None
        rows.append([r["case"], r["library"], r.get("runs", ""), r.get("p50_ms"), r.get("max_ms"),
                     r.get("artifact_bytes"), _x(r, ref, "p50_ms"), _x(r, ref, "artifact_bytes"), compile_status(r)])
    xgr = (f"xgrammar {setup['xgrammar_version']} {setup['xgrammar_tokenizer_s']:.1f} s"
           if "xgrammar_tokenizer_s" in setup else "xgrammar not installed")
    title = (f"\nepd bench grammar: cold compiles, a fresh process each (p50/max of {sizes['runs']}, pathological 1; "
             f"limit {args.timeout_s:g} s, {args.memory_gib:g} GiB); tokenizer builds: llguidance "
             f"{setup['llguidance_version']} {setup['llguidance_tokenizer_s']:.1f} s, {xgr}")
    print_table(["class", "library", "runs", "p50 ms", "max ms", "artifact bytes", "time vs llg", "size vs llg",
                 "status"], rows, title=title)
    print("\n".join(["classes:"] + [f"  {name:<15} {what}" for name, what in _classes(results)]), flush=True)


def print_masks(results: list[dict], sizes: dict) -> None:
    base = {r["case"]: r.get("walk") for r in results if r["library"] == "llguidance"}
    rows = []
    for r in results:
        w, ref = r.get("walk") or {}, base[r["case"]] if r["library"] != "llguidance" else None
        rows.append([r["case"], r["library"], w.get("tokens"), w.get("matcher_ms"), w.get("p50_us"), w.get("p99_us"),
                     w.get("max_us"), w.get("allowed_median"), w.get("restarts"),
                     _x(w, ref, "p50_us"), _x(w, ref, "p99_us"), mask_status(r)])
    print_table(["class", "library", "tokens", "matcher ms", "mask p50 us", "p99 us", "max us", "allowed p50",
                 "restarts", "p50 vs llg", "p99 vs llg", "status"], rows,
                title=f"\nmask per token: random walks of {sizes['tokens']} tokens (each drawn from the mask), "
                      f"one bitmask row of the whole vocabulary per fill")


def compile_status(result: dict) -> str:
    if "artifact_error" in result:
        return f"{result['status']}; artifact {result['artifact_error']}"
    return result["status"]


def mask_status(result: dict) -> str:
    if "walk" in result:
        return "ok"
    if "walk_error" in result:
        return f"walk failed, {result['walk_error']}"
    return result["status"]


def print_engine(rows: list[dict], case, sizes: dict, args) -> None:
    print_table(["batch", "steps", "plain ms/step", "masked ms/step", "masked/plain", "plain p90", "masked p90",
                 "fill ms", "apply ms", "grammars completed"],
                [[r["batch"], r["steps"], r["plain_ms"], r["masked_ms"], f"{r['ratio']:.2f}x", r["plain_p90_ms"],
                  r["masked_p90_ms"], r["fill_ms"], r["apply_ms"], r["grammars_completed"]] for r in rows],
                title=f"\nengine steps (EngineCore, {args.model_dir}, {args.device} {args.dtype}, {args.torch_threads} torch thread(s)): "
                      f"B requests decoding under the `{case.name}` schema vs the same B unconstrained; median of "
                      f"{sizes['rounds']} round(s) x {sizes['steps']} steps per side, sides taking turns; "
                      f"fill / apply = the step's grammar calls timed apart (B bitmask rows filled; applied to "
                      f"[B, V] float32 logits)")


def _x(row: dict, ref: dict | None, key: str) -> str:
    """row / ref as "1.23x", "" where either side has no number (or for the baseline itself)."""
    if not ref or row.get(key) is None or not ref.get(key):
        return ""
    return f"{row[key] / ref[key]:.2f}x"


def _classes(results: list[dict]) -> list[tuple[str, str]]:
    seen = {}
    for r in results:
        seen.setdefault(r["case"], r["what"])
    return list(seen.items())


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.grammar.command ...`: the same as `epd bench grammar ...` without the rest of the CLI."""
    parser = argparse.ArgumentParser(prog="epd bench grammar", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
