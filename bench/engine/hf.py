"""The Hugging Face side of `epd bench engine`: transformers' DeepseekV4ForCausalLM, measured cell by cell.

HF (the runner): builds the model on our tensors (hf_model.py), checks on one prompt that
both models give the same logits (casting its RMSNorm weights where transformers 5.17 needs it),
then per cell one eager forward over the B x C prompts and argmax decode steps on its own cache.
Host cells whose attention scores would not fit the free RAM are skipped; out-of-memory is a result.
"""
from __future__ import annotations

import time

from bench.engine.device import _free, _host_available, _is_oom, _peak_gib, _reset_peak, _sync
from bench.engine.hf_model import _cast_norms, hf_model_sharing
from bench.engine.plan import Cell, Prompts, Run
from bench.engine.runner import CellRunner

AGREEMENT_PROMPT = 256       # tokens of the prompt both models run to check they share weights


class HF(CellRunner):
    impl = "hf"

    def __init__(self, bench: Run, model, raw: dict, config, device, dtype, plan: dict, prompts: Prompts):
        super().__init__(bench, device, plan, prompts)
        self.our_model = model
        start = time.monotonic()
        self.model, sharing = hf_model_sharing(model, raw, config, device, dtype)
        bench.doc["hf_weights"] = sharing
        bench.log(f"HF: DeepseekV4ForCausalLM built on the same tensors in {time.monotonic() - start:.1f} s "
                  f"({sharing['shared_bytes'] / 2**30:.2f} GiB shared, {sharing['copied_bytes'] / 2**20:.2f} MiB "
                  f"copied to HF's dtypes, {sharing['copied']} tensors)")
        self.cache_kw = _cache_keyword(self.model)
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
                ours = self.our_model([prompt[0]], [self.our_model.new_state()])[0].float()
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
        super().measure(cells)
        self.model = None
        _free(self.device)

    def cannot_run(self, cell: Cell) -> str | None:
        """On the host an allocation that overcommits memory can bring the OOM killer instead of an
        exception: skip cells whose eager attention scores alone would not fit the free RAM."""
        if self.device.type == "cuda":
            return None
        config = self.our_model.config
        scores = cell.batch * config.num_heads * cell.context * (cell.context + cell.context // 4) * 4 * 3
        available = _host_available()
        if available is not None and scores > 0.5 * available:
            return (f"not run (RAM): its eager attention scores alone need ~{scores / 2**30:.0f} GiB, "
                    f"{available / 2**30:.0f} GiB free")
        return None

    def run_cell(self, cell: Cell) -> dict:
        """The cell's timings, or OOM with the peak memory reached."""
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
        return self.timings(cell, fill_s, times)


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
