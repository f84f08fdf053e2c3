"""Our side of `epd bench engine`: an EngineCore around the in-memory model, measured cell by cell.

Ours (the runner: warm-up, prefill of B prompts through continuous batching, timed decode steps),
build_engine (EngineCore handed the model instead of loading one), the page pool sized to the free
device memory, and profile_step (one decode step under torch.profiler).
"""
from __future__ import annotations

import time
from pathlib import Path

from bench.engine.device import _free, _reset_peak, _sync
from bench.engine.plan import Cell, OutOfTime, Prompts, Run
from bench.engine.runner import CellRunner

ACTIVATION_RESERVE = 24 << 30  # device bytes kept free for activations when sizing the page pool


class Ours(CellRunner):
    impl = "ours"

    def __init__(self, bench: Run, model, model_dir: Path, device, plan: dict, cells: list[Cell],
                 max_batched_tokens: int, prompts: Prompts, impl: str = "ours"):
        super().__init__(bench, device, plan, prompts)
        self.impl = impl  # "torch" for the torch-path baseline of --kernels compare
        self.model = model
        self.max_batched_tokens = max_batched_tokens
        max_batch = max(c.batch for c in cells)
        if max_batched_tokens <= max_batch:
            raise ValueError(f"--max-batched-tokens must exceed the largest batch ({max_batch})")
        # on a GPU the warm-up also feeds one full step (Triton kernels compile per size tier)
        self.warm_cells = [Cell(1, min(plan["contexts"]))]
        if getattr(device, "type", str(device)) == "cuda":
            self.warm_cells.append(Cell(1, max_batched_tokens - 1))
        wanted = max(self._pages(c) for c in [*cells, *self.warm_cells]) + 8
        self.num_pages, self.pool_note = _fit_pages(model, device, wanted)
        self.engine = build_engine(model, model_dir, device, num_pages=self.num_pages, max_num_seqs=max_batch,
                                   max_batched_tokens=max_batched_tokens, cuda_graphs=not bench.args.no_cuda_graphs)
        bench.doc["ours_engine"] = {"num_pages": self.num_pages, "pages_wanted": wanted, "pool_note": self.pool_note,
                                    "page_bytes": self.engine.kv.pool.layout.page_bytes(model.dtype),
                                    "max_num_seqs": max_batch, "max_batched_tokens": max_batched_tokens,
                                    "cuda_graphs": not bench.args.no_cuda_graphs and model.decode_graphs is not None}
        self.graphs_captured = 0  # CUDA graphs of decode steps captured so far (released before HF runs)
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
        for warm in self.warm_cells:
            self._add(warm, salt=1, max_tokens=3)
            while self.engine.has_unfinished():
                self.engine.step()
        _sync(self.device)
        self.prefill_rate = sum(c.context for c in self.warm_cells) / (time.monotonic() - start)
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

    def cannot_run(self, cell: Cell) -> str | None:
        pages = self._pages(cell)
        if pages > self.num_pages:
            return f"pool too small ({pages} pages needed, {self.num_pages} held: {self.pool_note})"
        return None

    def run_cell(self, cell: Cell) -> dict:
        try:
            return self._cell(cell)
        except OutOfTime as exc:
            for rid in self.engine.request_ids():
                self.engine.abort(rid)
            return {"status": str(exc)}

    def _cell(self, cell: Cell) -> dict:
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
        if engine.stats().num_preemptions != preemptions:
            raise RuntimeError("the engine preempted a sequence during the measurement")
        for rid in ids:
            engine.abort(rid)
        row = self.timings(cell, fill_s, times, prefill_steps=prefill_steps)
        if profile is not None:
            row["profile"] = profile
        return row

    def release_graphs(self) -> None:
        graphs = self.model.decode_graphs
        if graphs is None:  # V4.1 decodes eagerly for now (no CUDA-graph path yet)
            self.bench.doc["ours_engine"].update(graphs_captured=0, graphs_error="no CUDA-graph decode for this model")
            return
        self.graphs_captured += len(graphs.graphs)
        self.bench.doc["ours_engine"].update(graphs_captured=self.graphs_captured, graphs_error=graphs.error)
        graphs.clear()

    def close(self) -> None:
        self.release_graphs()
        self.engine = None
        _free(self.device)


def build_engine(model, model_dir: Path, device, **config):
    """An EngineCore around an in-memory model (`model_dir` holds only config.json, from which the
    engine derives its model identity)."""
    from engine.engine_core import EngineConfig, EngineCore
    return EngineCore(EngineConfig(model_dir=str(model_dir), device=str(device), enable_prefix_cache=False,
                                   swa_cache_bytes=0, **config), model=model)


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
