"""What the two runners of `epd bench engine` (ours in ours.py, HF in hf.py) share.

The loop over cells (skip or measure, add the row, log it), the time estimate a cell is checked
against --budget-s with, and the row of timings made from one prefill and the decode steps.
"""
from __future__ import annotations

from bench.engine.device import _peak_gib
from bench.engine.plan import Cell, Prompts, Run
from bench.engine.report import describe


class CellRunner:
    """Measures cells one at a time and adds one row per cell to the Run.

    A subclass sets `impl` (the rows' "impl") and gives `cannot_run(cell)` (why the cell is not run,
    or None) and `run_cell(cell)` (the row's measured fields, usually from `timings`)."""

    impl = ""

    def __init__(self, bench: Run, device, plan: dict, prompts: Prompts):
        self.bench, self.device, self.plan, self.prompts = bench, device, plan, prompts
        self.prefill_rate = None  # prefill tokens/s seen last, for the time-budget estimate
        self.step_s: dict[int, float] = {}  # the slowest mean decode step seen per batch size

    def measure(self, cells: list[Cell]) -> None:
        for cell in cells:
            row = {"impl": self.impl, "batch": cell.batch, "context": cell.context}
            skip = self.cannot_run(cell) or self.bench.over_budget(self.estimate_s(cell))
            if skip:
                row["status"] = skip
            else:
                row.update(self.run_cell(cell))
            self.bench.add(row)
            self.bench.log(describe(row))

    def cannot_run(self, cell: Cell) -> str | None:
        return None

    def run_cell(self, cell: Cell) -> dict:
        raise NotImplementedError

    def estimate_s(self, cell: Cell) -> float:
        """Seconds the cell should take: its prompts at the last prefill rate, then its decode steps."""
        return cell.batch * cell.context / (self.prefill_rate or 1e4) + self._decode_estimate(cell.batch)

    def _decode_estimate(self, batch: int) -> float:
        if not self.step_s:
            return (self.plan["warmup"] + self.plan["steps"]) * 0.5
        b, s = max(self.step_s.items())
        return (self.plan["warmup"] + self.plan["steps"]) * s * max(1.0, batch / b)

    def timings(self, cell: Cell, fill_s: float, times: list[float], prefill_steps: int | None = None) -> dict:
        """The row of an "ok" cell: prefill time and rate, decode step times (the first `warmup` of
        `times` left out of the mean and median), peak device memory. Remembers the step time."""
        timed = times[self.plan["warmup"]:]
        step_s = sum(timed) / len(timed)
        self.step_s[cell.batch] = max(step_s, self.step_s.get(cell.batch, 0.0))
        row = {"status": "ok", "prefill_s": round(fill_s, 4)}
        if prefill_steps is not None:
            row["prefill_steps"] = prefill_steps
        row.update(prefill_tokens_per_s=round(cell.batch * cell.context / fill_s, 1),
                   step_ms=round(1e3 * step_s, 3), step_ms_median=round(1e3 * sorted(timed)[len(timed) // 2], 3),
                   step_ms_all=[round(1e3 * t, 3) for t in times], warmup_steps=self.plan["warmup"],
                   peak_gib=_peak_gib(self.device))
        return row
