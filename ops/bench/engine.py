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
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ops.bench.table import print_table, write_json
from ops.bench.engine_device import (_device_name, _free, _host_available, _is_oom, _peak_gib,
                                     _reset_peak, _sync, _transformers_version, measure_rates)
from ops.bench.engine_weights import draw_model, weight_bytes, write_config_dir

FULL = {"batches": (1, 8, 64), "contexts": (2048, 8192), "warmup": 2, "steps": 6}
QUICK = {"batches": (1, 2), "contexts": (128, 256), "warmup": 1, "steps": 2}
GRACE_S = 60.0               # a measurement still running this long past --budget-s is cut short
ACTIVATION_RESERVE = 24 << 30  # device bytes kept free for activations when sizing the page pool
AGREEMENT_PROMPT = 256       # tokens of the prompt both models run to check they share weights


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
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="skip measurements that would end the run later than this (default 450 s)")


def _int_list(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(",") if v.strip())
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


# ---- plan ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    batch: int
    context: int


class OutOfTime(Exception):
    pass


@dataclass
class Run:
    """What the run has measured so far; `save` rewrites the JSON file."""

    args: argparse.Namespace
    t0: float = field(default_factory=time.monotonic)
    doc: dict = field(default_factory=dict)
    rows: list = field(default_factory=list)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def check_deadline(self, where: str) -> None:
        if self.elapsed() > self.args.budget_s + GRACE_S:
            raise OutOfTime(f"cut: past the time budget + {GRACE_S:.0f} s ({where})")

    def log(self, text: str) -> None:
        print(f"[{self.elapsed():7.1f}s] {text}", flush=True)

    def add(self, row: dict) -> dict:
        self.rows.append(row)
        self.save()
        return row

    def save(self, complete: bool = False) -> None:
        if self.args.json:
            write_json(self.args.json, "engine", {**self.doc, "rows": self.rows, "complete": complete,
                                                  "elapsed_s": round(self.elapsed(), 1)})


def run(args: argparse.Namespace) -> int:
    import torch
    plan = dict(QUICK if args.quick else FULL)
    if args.steps is not None:
        if args.steps < 1:
            print("epd bench engine: --steps must be >= 1", file=sys.stderr)
            return 2
        plan["steps"] = args.steps
    for name in ("batches", "contexts"):
        if getattr(args, name, None):
            plan[name] = tuple(getattr(args, name))
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("epd bench engine: CUDA is not available here (try --device cpu --config tiny)", file=sys.stderr)
        return 2
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    from engine.model.config import load_config, read_config_dict
    from engine.model.loader import parse_dtype
    raw, config, dtype = read_config_dict(args.config), load_config(args.config), parse_dtype(args.dtype)
    bench = Run(args)
    bench.doc = {"config": args.config, "device": str(device), "device_name": _device_name(device),
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

    start = time.monotonic()
    model = draw_model(config, device, dtype, args.seed)
    weights = weight_bytes(model)
    bench.doc["weights"] = {**weights, "draw_s": round(time.monotonic() - start, 1)}
    bench.log(f"weights drawn on {device}: {weights['total'] / 2**30:.1f} GiB "
              f"(dense {weights['dense'] / 1e9:.2f} GB, {weights['expert'] / 1e6:.1f} MB per expert) "
              f"in {time.monotonic() - start:.1f} s")

    cells = [Cell(b, c) for c in plan["contexts"] for b in plan["batches"]]
    bench.doc["floors"] = [floor_row(config, model, weights, rates, cell) for cell in cells]
    prompts = Prompts(config.vocab_size, args.seed)
    with tempfile.TemporaryDirectory(prefix="epd-bench-engine-") as tmp:
        model_dir = write_config_dir(raw, config, dtype, Path(tmp) / f"{Path(str(args.config)).stem}-random")
        ours = Ours(bench, model, model_dir, device, plan, cells, args.max_batched_tokens, prompts)
        big = max(cells, key=lambda c: c.batch * c.context)
        ours.measure([c for c in cells if c != big])
        ours.release_graphs()  # their memory pools would otherwise be taken from HF
        _free(device)
        if not args.skip_hf:
            HF(bench, model, raw, config, device, dtype, plan, prompts).measure(cells)
        _free(device)
        ours.measure([big])
        ours.close()
    bench.doc["elapsed_s"] = round(bench.elapsed(), 1)
    summary = summarize(bench.rows, bench.doc["floors"], cells, plan)
    bench.doc["summary"] = summary
    bench.save(complete=True)
    print_report(bench, summary)
    return 0


# ---- device rates --------------------------------------------------------------------------------
# ---- weights -------------------------------------------------------------------------------------
# ---- floor ---------------------------------------------------------------------------------------
def floor_row(config, model, weights: dict, rates: dict, cell: Cell) -> dict:
    from engine.kv.page_pool import PageLayout
    n, k = config.n_routed_experts, config.experts_per_token
    touched = n * (1 - (1 - k / n) ** cell.batch)
    layout = PageLayout.from_config(config, 128)
    dtype_bytes = model.model.embed_tokens.weight.element_size()
    kv_per_token = layout.page_numel * dtype_bytes / layout.block_size
    swa_per_seq = config.num_layers * config.sliding_window * config.head_dim * dtype_bytes
    kv = cell.batch * (cell.context * kv_per_token + swa_per_seq)
    experts = weights["moe_layers"] * touched * weights["expert"]
    decode_bytes = weights["dense"] + experts + kv
    lm_head = config.vocab_size * config.hidden_size
    prefill_flops = 2 * cell.batch * (cell.context * weights["active_params_per_token"] + lm_head)
    return {"batch": cell.batch, "context": cell.context, "experts_touched_per_layer": round(touched, 1),
            "decode_bytes": int(decode_bytes), "kv_bytes": int(kv), "kv_bytes_per_token": kv_per_token,
            "decode_floor_ms": 1e3 * decode_bytes / rates["copy_bytes_per_s"],
            "prefill_flops": prefill_flops,
            "prefill_floor_tokens_per_s": cell.batch * cell.context / (prefill_flops / rates["matmul_flops_per_s"])}


# ---- prompts -------------------------------------------------------------------------------------
class Prompts:
    """Distinct seeded random prompts (ids 2.. vocab, no BOS/EOS); the same for ours and HF."""

    def __init__(self, vocab: int, seed: int):
        self.vocab, self.seed = vocab, seed

    def batch(self, cell: Cell, salt: int = 0):
        import torch
        generator = torch.Generator().manual_seed(self.seed * 7919 + cell.batch * 100_003 + cell.context + salt)
        return torch.randint(2, self.vocab, (cell.batch, cell.context), generator=generator)


# ---- ours ----------------------------------------------------------------------------------------
class Ours:
    def __init__(self, bench: Run, model, model_dir: Path, device, plan: dict, cells: list[Cell],
                 max_batched_tokens: int, prompts: Prompts):
        self.bench, self.model, self.device, self.plan, self.prompts = bench, model, device, plan, prompts
        self.max_batched_tokens = max_batched_tokens
        max_batch = max(c.batch for c in cells)
        if max_batched_tokens <= max_batch:
            raise ValueError(f"--max-batched-tokens must exceed the largest batch ({max_batch})")
        wanted = max(self._pages(c) for c in cells) + 8
        self.num_pages, self.pool_note = _fit_pages(model, device, wanted)
        self.engine = build_engine(model, model_dir, device, num_pages=self.num_pages, max_num_seqs=max_batch,
                                   max_batched_tokens=max_batched_tokens, cuda_graphs=not bench.args.no_cuda_graphs)
        bench.doc["ours_engine"] = {"num_pages": self.num_pages, "pages_wanted": wanted, "pool_note": self.pool_note,
                                    "page_bytes": self.engine.kv.pool.layout.page_bytes(model.dtype),
                                    "max_num_seqs": max_batch, "max_batched_tokens": max_batched_tokens,
                                    "cuda_graphs": not bench.args.no_cuda_graphs}
        self.prefill_rate = None  # tokens/s seen last, for the time-budget estimate
        self.graphs_captured = 0  # CUDA graphs of decode steps captured so far (released before HF runs)
        self.step_s: dict[int, float] = {}
        self._warm_up()

    def _max_tokens(self, cell: Cell) -> int:
        """Tokens a request may generate: the first sequences in decode while the last still prefill
        (each fill step feeds at most max_batched_tokens - batch prompt tokens), then the measured steps."""
        fill_steps = -(-cell.batch * cell.context // (self.max_batched_tokens - cell.batch)) + cell.batch
        return fill_steps + self.plan["warmup"] + self.plan["steps"] + 8

    def _pages(self, cell: Cell) -> int:
        return cell.batch * -(-(cell.context + self._max_tokens(cell)) // 128)

    def _warm_up(self) -> None:
        """One request of the smallest context: first-call costs (kernels, allocator) out of the cells."""
        start = time.monotonic()
        cell = Cell(1, min(self.plan["contexts"]))
        self._add(cell, salt=1, max_tokens=3)
        while self.engine.has_unfinished():
            self.engine.step()
        _sync(self.device)
        self.prefill_rate = cell.context / (time.monotonic() - start)
        self.bench.log(f"ours: engine ready ({self.num_pages} pages), warm-up {time.monotonic() - start:.1f} s")

    def _add(self, cell: Cell, salt: int, max_tokens: int) -> list[str]:
        from engine.engine_core import EngineRequest
        from messages.common import SamplingParams
        ids = []
        for i, prompt in enumerate(self.prompts.batch(cell, salt).tolist()):
            rid = f"b{cell.batch}-c{cell.context}-s{salt}-{i}"
            self.engine.add_request(EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
            ids.append(rid)
        return ids

    def measure(self, cells: list[Cell]) -> None:
        for cell in cells:
            row = {"impl": "ours", "batch": cell.batch, "context": cell.context}
            pages = self._pages(cell)
            if pages > self.num_pages:
                row["status"] = f"pool too small ({pages} pages needed, {self.num_pages} held: {self.pool_note})"
            else:
                estimate = cell.batch * cell.context / self.prefill_rate + self._decode_estimate(cell.batch)
                if self.bench.elapsed() + estimate > self.bench.args.budget_s:
                    row["status"] = f"skipped: time budget (needs ~{estimate:.0f} s)"
                else:
                    try:
                        row.update(self._cell(cell))
                    except OutOfTime as exc:
                        row["status"] = str(exc)
                        for rid in self.engine.request_ids():
                            self.engine.abort(rid)
            self.bench.add(row)
            self.bench.log(_describe(row))

    def _decode_estimate(self, batch: int) -> float:
        if not self.step_s:
            return (self.plan["warmup"] + self.plan["steps"]) * 0.5
        b, s = max(self.step_s.items())
        return (self.plan["warmup"] + self.plan["steps"]) * s * max(1.0, batch / b)

    def _cell(self, cell: Cell) -> dict:
        import torch
        engine, device = self.engine, self.device
        _reset_peak(device)
        preemptions = engine.stats().num_preemptions
        ids = self._add(cell, salt=0, max_tokens=self._max_tokens(cell))
        started = set()
        start = time.perf_counter()
        prefill_steps = 0
        while len(started) < cell.batch:
            self.bench.check_deadline(f"prefill, {len(started)} of {cell.batch} sequences done")
            for out in engine.step():
                if out.new_token_ids:
                    started.add(out.request_id)
            prefill_steps += 1
        fill_s = time.perf_counter() - start
        self.prefill_rate = cell.batch * cell.context / fill_s
        times = []
        for _ in range(self.plan["warmup"] + self.plan["steps"]):
            self.bench.check_deadline(f"decode, after {len(times)} steps")
            t = time.perf_counter()
            outs = engine.step()
            times.append(time.perf_counter() - t)
            if len(outs) != cell.batch or any(len(o.new_token_ids) != 1 for o in outs):
                raise RuntimeError(f"expected a pure decode step of {cell.batch} tokens, got {len(outs)} outputs")
        profile = None
        if cell.context == min(self.plan["contexts"]) and cell.batch in sorted(self.plan["batches"])[:2]:
            profile = profile_step(engine, device)  # one extra decode step: where a step's time goes
        timed = times[self.plan["warmup"]:]
        step_s = sum(timed) / len(timed)
        self.step_s[cell.batch] = max(step_s, self.step_s.get(cell.batch, 0.0))
        if engine.stats().num_preemptions != preemptions:
            raise RuntimeError("the engine preempted a sequence during the measurement")
        for rid in ids:
            engine.abort(rid)
        row = {"status": "ok", "prefill_s": round(fill_s, 4), "prefill_steps": prefill_steps,
               "prefill_tokens_per_s": round(cell.batch * cell.context / fill_s, 1),
               "step_ms": round(1e3 * step_s, 3), "step_ms_median": round(1e3 * sorted(timed)[len(timed) // 2], 3),
               "step_ms_all": [round(1e3 * t, 3) for t in times], "warmup_steps": self.plan["warmup"],
               "peak_gib": _peak_gib(device)}
        if profile is not None:
            row["profile"] = profile
        return row

    def release_graphs(self) -> None:
        graphs = self.model.decode_graphs
        self.graphs_captured += len(graphs.graphs)
        self.bench.doc["ours_engine"].update(graphs_captured=self.graphs_captured, graphs_error=graphs.error)
        graphs.clear()

    def close(self) -> None:
        self.release_graphs()
        self.engine = None
        _free(self.device)


def build_engine(model, model_dir: Path, device, **config):
    """An EngineCore around an in-memory model.

    EngineCore loads its model from `model_dir` inside its constructor; here the loader it calls is
    swapped for one that hands over `model` for the length of the construction (`model_dir` holds
    only config.json, from which the engine derives its model identity)."""
    import engine.engine_core as core
    if not callable(getattr(core, "load_model", None)):
        raise RuntimeError("engine.engine_core no longer calls load_model: update ops.bench.engine.build_engine")
    original = core.load_model

    def hand_over(model_dir_arg, device_arg, dtype_arg=None):
        return model

    core.load_model = hand_over
    try:
        engine = core.EngineCore(core.EngineConfig(model_dir=str(model_dir), device=str(device),
                                                   enable_prefix_cache=False, swa_cache_bytes=0, **config))
    finally:
        core.load_model = original
    if engine.model is not model:
        raise RuntimeError("EngineCore did not take the in-memory model")
    return engine


def _fit_pages(model, device, wanted: int) -> tuple[int, str]:
    import torch
    from engine.kv.page_pool import PageLayout
    if device.type != "cuda":
        return wanted, "host memory"
    page_bytes = PageLayout.from_config(model.config, 128).page_bytes(model.dtype)
    free, _ = torch.cuda.mem_get_info(device)
    fits = max(0, (free - ACTIVATION_RESERVE) // page_bytes)
    if fits >= wanted:
        return wanted, f"{free / 2**30:.1f} GiB free"
    return int(fits), f"{free / 2**30:.1f} GiB free less {ACTIVATION_RESERVE >> 30} GiB for activations"


def profile_step(engine, device) -> dict:
    """One more decode step under torch.profiler: wall time against the device's busy time, top kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:
        start = time.perf_counter()
        with profile(activities=activities) as prof:
            engine.step()
            _sync(device)
        wall = time.perf_counter() - start
        events = prof.key_averages()
    except Exception as exc:  # noqa: BLE001 - a profiler that cannot start costs the profile, not the cell
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}
    if device.type == "cuda":
        key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    else:
        key = "self_cpu_time_total"
    ranked = sorted(events, key=lambda e: getattr(e, key), reverse=True)
    busy_us = sum(getattr(e, key) for e in events) if device.type == "cuda" else None
    launches = sum(e.count for e in events if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel")))
    return {"wall_ms_profiled": round(1e3 * wall, 2), "device_busy_ms": None if busy_us is None else round(busy_us / 1e3, 2),
            "kernel_launches": launches, "ops": sum(e.count for e in events if e.key.startswith("aten::")),
            "top": [{"name": e.key[:60], "ms": round(getattr(e, key) / 1e3, 3), "count": e.count} for e in ranked[:8]]}


# ---- Hugging Face ----------------------------------------------------------------------------------
class HF:
    def __init__(self, bench: Run, model, raw: dict, config, device, dtype, plan: dict, prompts: Prompts):
        self.bench, self.ours, self.device, self.plan, self.prompts = bench, model, device, plan, prompts
        start = time.monotonic()
        self.model, sharing = hf_model_sharing(model, raw, config, device, dtype)
        bench.doc["hf_weights"] = sharing
        bench.log(f"HF: DeepseekV4ForCausalLM built on the same tensors in {time.monotonic() - start:.1f} s "
                  f"({sharing['shared_bytes'] / 2**30:.2f} GiB shared, {sharing['copied_bytes'] / 2**20:.2f} MiB "
                  f"copied to HF's dtypes, {sharing['copied']} tensors)")
        self.cache_kw = _cache_keyword(self.model)
        self.prefill_rate = None
        self.step_s: dict[int, float] = {}
        result = self._agreement()
        if "dtype" in result.get("error", ""):
            # transformers 5.17's RMSNorm multiplies an fp32 weight into the activation and returns fp32,
            # which its next bf16 projection rejects (`from_pretrained` in bf16 fails the same way; 5.24
            # fixed it). Give its norms weights in the model dtype (copies, kilobytes) and check again.
            names = _cast_norms(self.model, dtype)
            sharing.update(norms_cast_to=str(dtype).removeprefix("torch."), norms_cast=len(names),
                           norms_cast_why=result["error"][:200])
            bench.log(f"HF: {result['error'][:120]}; its {len(names)} RMSNorm weights cast to {dtype}, retrying")
            self._agreement()

    def _agreement(self) -> dict:
        """Last-token logits of one prompt from both models: they must be the same weights."""
        import torch
        prompt = self.prompts.batch(Cell(1, AGREEMENT_PROMPT), salt=2).to(self.device)
        start = time.monotonic()
        try:
            with torch.inference_mode():
                ours = self.ours([prompt[0]], [self.ours.new_state()])[0].float()
                theirs = self.model(input_ids=prompt, use_cache=False, logits_to_keep=1).logits[0, -1].float()
            _sync(self.device)
            self.prefill_rate = AGREEMENT_PROMPT / (time.monotonic() - start)
            rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
            top = ours.topk(5).indices.tolist(), theirs.topk(5).indices.tolist()
            result = {"prompt_tokens": AGREEMENT_PROMPT, "max_rel_err": round(rel, 5),
                      "argmax_equal": top[0][0] == top[1][0], "top5_overlap": len(set(top[0]) & set(top[1]))}
        except Exception as exc:  # noqa: BLE001 - reported, the timings still run
            result = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        self.bench.doc["agreement"] = result
        self.bench.log(f"HF vs ours on one {AGREEMENT_PROMPT}-token prompt: {result}")
        return result

    def measure(self, cells: list[Cell]) -> None:
        for cell in cells:
            row = {"impl": "hf", "batch": cell.batch, "context": cell.context}
            estimate = cell.batch * cell.context / (self.prefill_rate or 1e4) + self._decode_estimate(cell.batch)
            skip = self._memory_guard(cell)
            if skip:
                row["status"] = skip
            elif self.bench.elapsed() + estimate > self.bench.args.budget_s:
                row["status"] = f"skipped: time budget (needs ~{estimate:.0f} s)"
            else:
                row.update(self._guarded(cell))
            self.bench.add(row)
            self.bench.log(_describe(row))
        self.model = None
        _free(self.device)

    def _decode_estimate(self, batch: int) -> float:
        if not self.step_s:
            return (self.plan["warmup"] + self.plan["steps"]) * 0.5
        b, s = max(self.step_s.items())
        return (self.plan["warmup"] + self.plan["steps"]) * s * max(1.0, batch / b)

    def _memory_guard(self, cell: Cell) -> str | None:
        """On the host an allocation that overcommits memory can bring the OOM killer instead of an
        exception: skip cells whose eager attention scores alone would not fit the free RAM."""
        if self.device.type == "cuda":
            return None
        config = self.ours.config
        scores = cell.batch * config.num_heads * cell.context * (cell.context + cell.context // 4) * 4 * 3
        available = _host_available()
        if available is not None and scores > 0.5 * available:
            return (f"not run (RAM): its eager attention scores alone need ~{scores / 2**30:.0f} GiB, "
                    f"{available / 2**30:.0f} GiB free")
        return None

    def _guarded(self, cell: Cell) -> dict:
        _reset_peak(self.device)
        result = None
        try:
            result = self._cell(cell)
        except Exception as exc:  # noqa: BLE001 - only out-of-memory is a result; the rest propagates
            if not _is_oom(exc):
                raise
            result = {"status": "OOM", "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}",
                      "peak_gib": _peak_gib(self.device)}
        _free(self.device)  # after the except block: the traceback no longer pins the tensors
        return result

    def _cell(self, cell: Cell) -> dict:
        import torch
        prompt = self.prompts.batch(cell).to(self.device)
        with torch.inference_mode():
            start = time.perf_counter()
            out = self.model(input_ids=prompt, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            _sync(self.device)
            fill_s = time.perf_counter() - start
            cache = _output_cache(out)
            del out, prompt
            self.prefill_rate = cell.batch * cell.context / fill_s
            times = []
            for _ in range(self.plan["warmup"] + self.plan["steps"]):
                t = time.perf_counter()
                out = self.model(input_ids=token, use_cache=True, logits_to_keep=1, **{self.cache_kw: cache})
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                token.tolist()  # the host sees the tokens, as a server would
                times.append(time.perf_counter() - t)
                cache = _output_cache(out)
                del out
        del cache
        timed = times[self.plan["warmup"]:]
        step_s = sum(timed) / len(timed)
        self.step_s[cell.batch] = max(step_s, self.step_s.get(cell.batch, 0.0))
        return {"status": "ok", "prefill_s": round(fill_s, 4),
                "prefill_tokens_per_s": round(cell.batch * cell.context / fill_s, 1),
                "step_ms": round(1e3 * step_s, 3), "step_ms_median": round(1e3 * sorted(timed)[len(timed) // 2], 3),
                "step_ms_all": [round(1e3 * t, 3) for t in times], "warmup_steps": self.plan["warmup"],
                "peak_gib": _peak_gib(self.device)}


def hf_model_sharing(model, raw: dict, config, device, dtype):
    """transformers' DeepseekV4ForCausalLM on `model`'s tensors.

    Built with its parameters on the meta device, then given our state dict with `assign=True`: each tensor whose dtype is
    the one `from_pretrained` would give that parameter is shared (same storage); the others (small:
    norms, hyper-connection and bias parameters where the two disagree) are copied. Buffers computed
    at construction (rotary tables) are moved to the device."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    from engine.model.random_init import _hf_config
    hf_dict = _hf_config(dict(raw), config, dtype)
    hf_dict.pop("model_type", None)
    hf_config = DeepseekV4Config(**hf_dict)
    with _parameters_on_meta():
        hf = DeepseekV4ForCausalLM(hf_config)
    strict = getattr(DeepseekV4ForCausalLM, "_keep_in_fp32_modules_strict", None) or []
    fp32 = re.compile(r"((^|\.)(" + "|".join(map(re.escape, strict)) + r")($|\.))") if strict else None
    ours = model.state_dict()
    expected = hf.state_dict()
    if set(ours) != set(expected):
        raise RuntimeError(f"parameter names differ: ours only {sorted(set(ours) - set(expected))[:5]}, "
                           f"HF only {sorted(set(expected) - set(ours))[:5]}")
    tensors, stats = {}, {"shared": 0, "copied": 0, "shared_bytes": 0, "copied_bytes": 0, "copied_names": []}
    for name, meta in expected.items():
        src = ours[name]
        if tuple(src.shape) != tuple(meta.shape):
            raise RuntimeError(f"{name}: ours {tuple(src.shape)} vs HF {tuple(meta.shape)}")
        if src.is_floating_point():
            want = torch.float32 if fp32 is not None and fp32.search(name) else dtype
        else:
            want = meta.dtype
        nbytes = src.numel() * src.element_size()
        if src.dtype == want:
            tensors[name] = src
            stats["shared"] += 1
            stats["shared_bytes"] += nbytes
        else:
            tensors[name] = src.to(want)
            stats["copied"] += 1
            stats["copied_bytes"] += tensors[name].numel() * tensors[name].element_size()
            stats["copied_names"].append(name)
    hf.load_state_dict(tensors, strict=True, assign=True)
    hf.to(device)  # the buffers computed at construction (rotary tables); parameters are there already
    left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"HF tensors left on the meta device: {left[:5]}")
    stats["copied_names"] = stats["copied_names"][:12]
    hf.requires_grad_(False)
    return hf.eval(), stats


def _cast_norms(hf, dtype) -> list[str]:
    import torch
    from torch import nn
    names = []
    for name, module in hf.named_modules():
        weight = getattr(module, "weight", None)
        if type(module).__name__.endswith("RMSNorm") and isinstance(weight, nn.Parameter) and weight.dtype != dtype:
            module.weight = nn.Parameter(weight.detach().to(dtype), requires_grad=False)
            names.append(name)
    return names


@contextmanager
def _parameters_on_meta():
    """Parameters created inside go to the meta device as they are registered (no memory, no init
    cost); buffers stay real, so tables computed at construction (rotary frequencies) survive."""
    from torch import nn
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None:
            moved = module._parameters[name]
            module._parameters[name] = type(moved)(moved.to("meta"), requires_grad=moved.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _cache_keyword(hf) -> str:
    import inspect
    params = inspect.signature(hf.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _output_cache(out):
    for name in ("cache", "past_key_values"):
        value = getattr(out, name, None)
        if value is not None:
            return value
    raise RuntimeError("the HF output carries no cache")


# ---- summary and report --------------------------------------------------------------------------
def summarize(rows: list[dict], floors: list[dict], cells: list[Cell], plan: dict) -> list[dict]:
    """One line per (measure, batch, context): ours, HF, floor and the ratios."""
    by = {(r["impl"], r["batch"], r["context"]): r for r in rows}
    floor = {(f["batch"], f["context"]): f for f in floors}
    out = []
    for kind in ("decode", "prefill"):
        for cell in cells:
            ours, hf = by.get(("ours", cell.batch, cell.context)), by.get(("hf", cell.batch, cell.context))
            f = floor[cell.batch, cell.context]
            line = {"measure": kind, "batch": cell.batch, "context": cell.context}
            if kind == "decode":
                line.update(unit="ms/step", ours=_value(ours, "step_ms"), hf=_value(hf, "step_ms"),
                            floor=round(f["decode_floor_ms"], 3))
                line["vs_hf"] = _ratio(line["hf"], line["ours"])
                line["x_floor"] = _ratio(line["ours"], line["floor"])
            else:
                line.update(unit="tokens/s", ours=_value(ours, "prefill_tokens_per_s"),
                            hf=_value(hf, "prefill_tokens_per_s"), floor=round(f["prefill_floor_tokens_per_s"], 1))
                line["vs_hf"] = _ratio(line["ours"], line["hf"])
                line["x_floor"] = _ratio(line["floor"], line["ours"])
            out.append(line)
    return out


def _value(row: dict | None, key: str):
    if row is None:
        return "not run"
    status = row.get("status", "?")
    if status != "ok":   # the short form; the row in the JSON (and the table above) has the whole reason
        return next((short for prefix, short in (("OOM", "OOM"), ("not run (RAM)", "not run (RAM)"),
                                                  ("skipped", "skipped (time)"),
                                                  ("cut", "cut (time)"), ("pool", "pool too small"))
                     if status.startswith(prefix)), status[:20])
    return row[key]


def _ratio(a, b):
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b:
        return round(a / b, 2)
    return None


def print_report(bench: Run, summary: list[dict]) -> None:
    doc = bench.doc
    rows = [r for r in bench.rows]
    detail = [[r["impl"], r["batch"], r["context"], r.get("status", "")[:70],
               _fmt(r.get("prefill_tokens_per_s")), _fmt(r.get("step_ms")), _fmt(r.get("step_ms_median")),
               _fmt(r.get("peak_gib"))] for r in rows]
    print_table(["impl", "batch", "context", "status", "prefill tok/s", "step ms", "median ms", "peak GiB"],
                detail, title="\nmeasurements (step = one decode token for every sequence of the batch)")
    agreement = doc.get("agreement")
    rates = doc["rates"]
    notes = [f"weights: {doc['weights']['total'] / 2**30:.1f} GiB random {doc['dtype']} drawn on {doc['device']} "
             f"(seed {doc['seed']}); dense {doc['weights']['dense'] / 1e9:.2f} GB + "
             f"{doc['weights']['expert'] / 1e6:.1f} MB per touched expert per layer",
             f"copy rate {rates['copy_bytes_per_s'] / 1e12:.2f} TB/s (read+write), matmul "
             f"{rates['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s"]
    if "hf_weights" in doc:
        notes.append(f"HF shares {doc['hf_weights']['shared_bytes'] / 2**30:.2f} GiB of our tensors; "
                     f"agreement on one prompt: {agreement}")
    print("\n" + "\n".join(notes), flush=True)
    table = [[f"{s['measure']} {s['unit']}", s["batch"], s["context"], _fmt(s["ours"]), _fmt(s["hf"]),
              _fmt(s["floor"]), _x(s["vs_hf"]), _x(s["x_floor"])] for s in summary]
    title = (f"\nepd bench engine: {doc['config']} on {doc['device_name']}, {doc['dtype']}, "
             f"torch {doc['torch']}, transformers {doc['transformers']}; "
             "vs HF = times faster than HF; x floor = times the floor (decode: bytes / copy rate; "
             "prefill: active-weight FLOPs / matmul rate)")
    print_table(["measure", "batch", "context", "ours", "HF", "floor", "vs HF", "x floor"], table, title=title)


def _fmt(value):
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:,.3g}" if abs(value) < 10 else f"{value:,.2f}"
    return value


def _x(value):
    return "" if value is None else f"{value:.2f}x"


def _describe(row: dict) -> str:
    head = f"{row['impl']:4s} b={row['batch']:<3d} ctx={row['context']:<5d}"
    if row.get("status") != "ok":
        return f"{head} {row.get('status')} {row.get('error', '')}"
    text = (f"{head} prefill {row['prefill_s']:.2f} s ({row['prefill_tokens_per_s']:,.0f} tok/s), "
            f"decode step {row['step_ms']:.2f} ms (median {row['step_ms_median']:.2f}), peak {row['peak_gib']} GiB")
    p = row.get("profile")
    if p and "error" in p:
        text += f"\n      profiled step: {p['error']}"
    elif p:
        text += (f"\n      profiled step: wall {p['wall_ms_profiled']} ms, device busy {p['device_busy_ms']} ms, "
                 f"{p['kernel_launches']} launches, {p['ops']} aten ops; top: "
                 + ", ".join(f"{t['name']} {t['ms']}ms x{t['count']}" for t in p["top"][:5]))
    return text


# ---- helpers -------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """`python -m ops.bench.engine ...`: the same as `epd bench engine ...` without the rest of the CLI."""
    parser = argparse.ArgumentParser(prog="epd bench engine", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
