"""What `epd bench engine` measures and the record it keeps.

The plan presets (FULL, QUICK) and how the command line adjusts them, a Cell (batch x context), the
seeded random prompts both implementations get, and Run: the clock, the time budget, the progress
log and the JSON document rewritten after every measurement.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

from bench.common.table import write_json

FULL = {"batches": (1, 8, 64), "contexts": (2048, 8192), "warmup": 2, "steps": 6}
QUICK = {"batches": (1, 2), "contexts": (128, 256), "warmup": 1, "steps": 2}
GRACE_S = 60.0               # a measurement still running this long past --budget-s is cut short


def make_plan(args: argparse.Namespace) -> dict:
    """FULL or QUICK, with --steps, --batches and --contexts applied (--steps already checked >= 1)."""
    plan = dict(QUICK if args.quick else FULL)
    if args.steps is not None:
        plan["steps"] = args.steps
    for name in ("batches", "contexts"):
        if getattr(args, name, None):
            plan[name] = tuple(getattr(args, name))
    return plan


@dataclass(frozen=True)
class Cell:
    batch: int
    context: int


def plan_cells(plan: dict) -> list[Cell]:
    """Every (batch, context) of the plan, context-major: the order of the floors and the summary."""
    return [Cell(b, c) for c in plan["contexts"] for b in plan["batches"]]


class Prompts:
    """Distinct seeded random prompts (ids 2.. vocab, no BOS/EOS); the same for ours and HF."""

    def __init__(self, vocab: int, seed: int):
        self.vocab, self.seed = vocab, seed

    def batch(self, cell: Cell, salt: int = 0):
        import torch
        generator = torch.Generator().manual_seed(self.seed * 7919 + cell.batch * 100_003 + cell.context + salt)
        return torch.randint(2, self.vocab, (cell.batch, cell.context), generator=generator)


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

    def over_budget(self, estimate_s: float) -> str | None:
        """Why a measurement expected to take `estimate_s` is skipped, or None if it fits --budget-s."""
        if self.elapsed() + estimate_s > self.args.budget_s:
            return f"skipped: time budget (needs ~{estimate_s:.0f} s)"
        return None

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
