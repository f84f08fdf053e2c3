"""`epd bench engine`: our EngineCore against Hugging Face's DeepseekV4ForCausalLM and the memory floor.

One run, one process, one set of weights:

  weights  random, seeded, drawn in place on the device (never zeros; tid2eid, position biases, sinks
           and correction biases randomised too): our DeepseekV4 is built on the meta device and each
           parameter is allocated on `--device` and filled by its own generator (seed, name). bench8 is
           100 GiB in bf16: it fits an H200 once, so nothing is written to disk and HF shares it.
  ours     an EngineCore around that in-memory model (prefix cache off: the prompts are distinct).
           decode (B, C): B prompts of C random tokens go in together; the engine prefills them
           (continuous batching, --max-batched-tokens per step), which gives prefill tokens/s at
           B x C; then warm-up steps, then timed steps where every step decodes one token for each
           of the B sequences (`EngineCore.step`, sampling and host round trip included).
  HF       transformers' DeepseekV4ForCausalLM built with its parameters on the meta device and given
           the very same tensors (load_state_dict(assign=True): shared storage; a parameter whose dtype
           differs from what `from_pretrained` keeps would be copied). Where its RMSNorm cannot take
           fp32 weights in a bf16 model (transformers 5.17: `from_pretrained` fails the same way), its
           norm weights are cast to the model dtype (copies, kilobytes); the JSON says so. Eager
           attention, its own cache: one forward over the B x C prompts (prefill tokens/s), then decode
           steps (argmax, tokens to the host). Out-of-memory is caught and reported as OOM. Before the
           timings both models run one prompt and the JSON records how far their logits agree.
  floor    decode: bytes a step must read / the device copy rate measured here (a large tensor copy,
           read + write counted): dense weights + the expected distinct routed experts touched by
           B tokens in every MoE layer (N * (1 - (1 - k/N)^B)) + the block KV and SWA windows of the
           B sequences. prefill: the active weights' matmul FLOPs / the bf16 matmul rate measured here
           (attention FLOPs left out: a lower bound).

The last table gives ours beside HF and the floor: `vs HF` = how many times faster ours is (HF time /
ours time), `x floor` = ours time / floor time. Cells that do not fit the page pool, run out of
memory, or would overrun `--budget-s` are marked as such. `--json FILE` is rewritten after every
measurement (`complete: false` until the end), so a cut-off run still leaves its numbers.

DeepSeek V4.1 (a config whose model_type is deepseek_v41, e.g. `--config bench-v41`): the weights are
drawn in the RELEASED formats (FP8 32x32 / MXFP4 / FP8 Engram tables with e8m0 scales) and go through
our own loader and dequantizers (weights_v41.py); HF is not run (transformers has no V4.1
model), its rows say so; the decode floor is given twice (floor_v41.py): `floor` counts the
weights as our engine holds them today (dequantized) and `floor q` the release's quantized bytes.
`--layers N` keeps a V4.1 config's first N layers.

Where each part lives (all under bench/engine/):

  command.py      the command: options, the order of the run (this file)
  plan.py         plan presets, cells, seeded prompts; Run: clock, time budget, log, JSON
  device.py       copy and matmul rates, syncs, memory peaks, OOM detection
  weights.py      random weights drawn in place, their sizes, the config-only model directory
  floor.py        the floor of each cell (decode bytes / copy rate, prefill FLOPs / matmul rate)
  runner.py       what ours and HF share: the cell loop, time estimates, the row of timings
  ours.py         ours: the EngineCore around the in-memory model, page pool, profiled step
  hf.py           HF: the agreement check, eager prefill + decode on its cache, OOM as a result
  hf_model.py     HF's DeepseekV4ForCausalLM built on our tensors (shared storage)
  report.py       the tables, notes and the summary (vs HF, x floor)
  weights_v41.py, floor_v41.py   V4.1: released-format weights drawn in place, two floors
  formats.py      --weights released / --kernels compare: held bytes, the kernel-vs-torch logits check
"""
from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from pathlib import Path

from bench.engine.device import _device_name, _free, _transformers_version, measure_rates
from bench.engine.floor import floor_row
from bench.engine.formats import AGREEMENT_TOKENS, compare_logits, held_bytes, last_logits
from bench.engine.floor_v41 import floor_row_v41
from bench.engine.hf import HF
from bench.engine.ours import Ours
from bench.engine.plan import FULL, QUICK, Cell, Prompts, Run, make_plan, plan_cells
from bench.engine.report import print_report, summarize
from bench.engine.weights import draw_model, weight_bytes, write_config_dir
from bench.engine.weights_v41 import (HF_NOT_RUN, draw_v41_model, is_v41_raw, sanity_check, v41_weight_bytes,
                                      with_layers, write_v41_model_dir)

__all__ = ["FULL", "QUICK", "add_arguments", "main", "register", "run"]  # FULL, QUICK: the presets, read by tests


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "engine", help="EngineCore decode/prefill vs transformers' DeepseekV4 and the memory floor (random weights)")
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="bench8", help="bundled config name or config.json path (default bench8)")
    parser.add_argument("--device", default="cuda", help="torch device (default cuda)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--quick", action="store_true",
                        help=f"batches {QUICK['batches']}, contexts {QUICK['contexts']}, {QUICK['steps']} timed steps")
    parser.add_argument("--json", metavar="FILE", help="also write every number to FILE (rewritten as it goes)")
    parser.add_argument("--skip-hf", action="store_true", help="do not build or run the transformers reference")
    parser.add_argument("--seed", type=int, default=0, help="weights and prompts seed (default 0)")
    parser.add_argument("--steps", type=int, help="timed decode steps per cell (default 6; 2 with --quick)")
    parser.add_argument("--batches", type=_int_list, help="batch sizes, comma-separated (default 1,8,64)")
    parser.add_argument("--contexts", type=_int_list, help="context lengths, comma-separated (default 2048,8192)")
    parser.add_argument("--max-batched-tokens", type=int, default=8192,
                        help="engine tokens per step while prefilling (default 8192)")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="run our decode steps eagerly (batched) instead of replaying CUDA graphs")
    parser.add_argument("--layers", type=int, help="V4.1 configs: keep only the first N decoder layers")
    parser.add_argument("--weights", choices=("model", "released"), default="model",
                        help="model: every weight in --dtype (default); released: MXFP4 routed experts and FP8 "
                             "linears as DeepSeek ships them, held packed by the kernel path")
    parser.add_argument("--kernels", choices=("auto", "off", "compare"), default="auto",
                        help="auto: fused kernels on CUDA (default); off: our torch path; compare: the torch path "
                             "first, then the kernels, on the same weights (the table gains `vs torch`)")
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="skip measurements that would end the run later than this (default 450 s)")
    parser.add_argument("--plot", metavar="FILE", help="also draw tokens/s against batch to FILE (PNG)")


def _int_list(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(",") if v.strip())
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def run(args: argparse.Namespace) -> int:
    import torch

    from engine.kernels import kernel_mode
    from engine.quant.pack_model import pack_model_
    if args.steps is not None and args.steps < 1:
        print("epd bench engine: --steps must be >= 1", file=sys.stderr)
        return 2
    plan = make_plan(args)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("epd bench engine: CUDA is not available here (try --device cpu --config tiny)", file=sys.stderr)
        return 2
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    from engine.models.v4.config import read_config_dict
    from engine.models.v4.loader import parse_dtype
    raw, dtype = read_config_dict(args.config), parse_dtype(args.dtype)
    v41 = is_v41_raw(raw)
    if args.layers is not None and not v41:
        print("epd bench engine: --layers applies to V4.1 configs only", file=sys.stderr)
        return 2
    if v41:
        from engine.models.v41.config import load_v41_config
        raw = with_layers(raw, args.layers)
        config = load_v41_config(raw)
    else:
        from engine.models.v4.config import load_config
        config = load_config(args.config)
    bench = Run(args)
    bench.doc = {"config": args.config, "arch": "v4.1" if v41 else "v4", "layers": config.num_layers,
                 "device": str(device), "device_name": _device_name(device),
                 "dtype": args.dtype, "seed": args.seed, "plan": {k: list(v) if isinstance(v, tuple) else v
                                                                  for k, v in plan.items()},
                 "max_batched_tokens": args.max_batched_tokens, "torch": torch.__version__,
                 "transformers": _transformers_version(), "prefix_cache": False}
    bench.log(f"epd bench engine: {args.config} on {bench.doc['device_name']} ({device}), {args.dtype}, "
              f"torch {torch.__version__}, transformers {bench.doc['transformers']}")
    rates = measure_rates(device, dtype)
    bench.doc["rates"] = rates
    bench.log(f"copy rate {rates['copy_bytes_per_s'] / 1e12:.2f} TB/s (read+write), "
              f"matmul {rates['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s ({args.dtype})")

    cells = plan_cells(plan)
    prompts = Prompts(config.vocab_size, args.seed)
    with tempfile.TemporaryDirectory(prefix="epd-bench-engine-") as tmp:
        model_dir = Path(tmp) / f"{Path(str(args.config)).stem}-random"
        start = time.monotonic()
        if v41:  # released formats drawn in place, through our loader (config.json + tokenizer.json only)
            model = draw_v41_model(write_v41_model_dir(raw, config, model_dir), device, dtype, args.seed)
            weights = v41_weight_bytes(model)
        else:
            model = draw_model(config, device, dtype, args.seed)
            weights = weight_bytes(model)
            write_config_dir(raw, config, dtype, model_dir)
        bench.doc["weights"] = {**weights, "draw_s": round(time.monotonic() - start, 1)}
        bench.log(f"weights drawn on {device}: {weights['total'] / 2**30:.1f} GiB "
                  f"(dense {weights['dense'] / 1e9:.2f} GB, {weights['expert'] / 1e6:.1f} MB per expert) "
                  f"in {time.monotonic() - start:.1f} s")
        if v41:
            released = weights["released"]
            bench.log(f"as released: {released['total'] / 2**30:.1f} GiB (dense {released['dense'] / 1e9:.2f} GB, "
                      f"{released['expert'] / 1e6:.1f} MB per expert); Engram tables "
                      f"{weights['engram_table_host_bytes'] / 2**30:.2f} GiB in host memory")
            bench.doc["floors"] = [floor_row_v41(config, weights, rates, cell) for cell in cells]
            bench.doc["sanity"] = sanity_check(model, prompts.batch(Cell(1, 64), salt=2)[0])
            bench.log(f"one 64-token prompt: {bench.doc['sanity']}")
        else:
            bench.doc["floors"] = [floor_row(config, model, weights, rates, cell) for cell in cells]
        def run_hf():
            if v41:  # said in every HF row, the notes and the JSON
                bench.doc["hf"] = HF_NOT_RUN
                for cell in cells:
                    bench.add({"impl": "hf", "batch": cell.batch, "context": cell.context, "status": HF_NOT_RUN})
            elif not args.skip_hf:
                HF(bench, model, raw, config, device, dtype, plan, prompts).measure(cells)
            _free(device)

        def make_ours(impl: str) -> Ours:
            return Ours(bench, model, model_dir, device, plan, cells, args.max_batched_tokens, prompts, impl=impl)

        big = max(cells, key=lambda c: c.batch * c.context)
        if args.weights == "model" and args.kernels != "compare":
            with kernel_mode(args.kernels):
                ours = make_ours("ours")
                ours.measure([c for c in cells if c != big])
                ours.release_graphs()  # their memory pools would otherwise be taken from HF
                _free(device)
                run_hf()
                ours.measure([big])
                ours.close()
        else:  # plain weights first (torch path, HF), then the kernel path (packed when released)
            reference = formats_phase_one(bench, model, args, cells, big, prompts, make_ours, run_hf)
            if args.weights == "released":
                bench.doc["packed"] = pack_model_(model)
                weights = held_bytes(model, weights)
                bench.doc["weights_held"] = {k: weights[k] for k in ("dense", "routed", "expert")}
                floor = (lambda cell: floor_row_v41(config, weights, rates, cell)) if v41 else \
                    (lambda cell: floor_row(config, model, weights, rates, cell))
                bench.doc["floors"] = [floor(cell) for cell in cells]
                bench.log(f"packed: {bench.doc['packed']}; held now: dense {weights['dense'] / 1e9:.2f} GB, "
                          f"{weights['expert'] / 1e6:.2f} MB per expert")
            with kernel_mode("auto" if args.kernels == "compare" else args.kernels):
                if reference is not None:
                    prompt = prompts.batch(Cell(1, AGREEMENT_TOKENS), salt=2)[0]
                    bench.doc["kernel_agreement"] = compare_logits(last_logits(model, prompt), reference)
                    bench.log(f"kernels vs torch path on one {AGREEMENT_TOKENS}-token prompt: "
                              f"{bench.doc['kernel_agreement']}")
                ours = make_ours("ours")
                ours.measure(cells)
                ours.close()
    bench.doc["elapsed_s"] = round(bench.elapsed(), 1)
    summary = summarize(bench.rows, bench.doc["floors"], cells, plan)
    bench.doc["summary"] = summary
    bench.save(complete=True)
    print_report(bench, summary)
    if args.plot:
        from bench.engine.plot import write_plot
        date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        print(f"plot: {write_plot({**bench.doc, 'date': date}, args.plot)}")
    return 0


def formats_phase_one(bench, model, args, cells, big, prompts, make_ours, run_hf):
    """Before packing: round the weights onto the release's grids (--weights released), measure the
    torch path (--kernels compare) and HF on them. Returns the torch path's agreement logits, or None."""
    from engine.kernels import kernel_mode
    from engine.quant.pack_model import round_to_formats_
    if args.weights == "released":
        bench.doc["rounded"] = round_to_formats_(model)
    if args.kernels != "compare":
        run_hf()
        return None
    with kernel_mode("off"):
        reference = last_logits(model, prompts.batch(Cell(1, AGREEMENT_TOKENS), salt=2)[0])
        torch_path = make_ours("torch")
        torch_path.measure([c for c in cells if c != big])
        torch_path.release_graphs()
        _free(model.device)
        run_hf()
        torch_path.measure([big])
        torch_path.close()
    return reference


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.engine.command ...`: the same as `epd bench engine ...` without the rest of the CLI."""
    parser = argparse.ArgumentParser(prog="epd bench engine", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
