"""What a scenario reports (Row), how outputs are compared with the fault-free run, and the table
`epd chaos` prints. Pure functions: the tests run them without processes."""
from __future__ import annotations

import collections
from dataclasses import asdict, dataclass, field

HEADERS = ("scenario", "requests", "completed", "identical", "longest stall s", "errors", "result")
ERROR_CELL = 60                      # characters of the commonest error shown in the table


@dataclass(slots=True)
class Row:
    scenario: str
    requests: int = 0
    completed: int = 0
    identical: int | None = None     # None: the scenario has no fault-free run to compare with
    compared: int | None = None      # how many outputs were compared (default: all requests)
    stall_s: float | None = None
    errors: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)   # checks that did not hold (empty: passed)
    notes: list[str] = field(default_factory=list)      # what happened: fault, timings, numbers
    detail: list[dict] = field(default_factory=list)    # one entry per request (JSON only)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures

    def check(self, holds: bool, failure: str) -> bool:
        """Record `failure` unless `holds`; returns holds."""
        if not holds:
            self.failures.append(failure)
        return holds

    def as_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def compare_output(baseline: str, got: str) -> str:
    """"identical", or how `got` differs from the fault-free `baseline` (exact text)."""
    if got == baseline:
        return "identical"
    if not got:
        return "no output"
    if baseline.startswith(got):
        return f"truncated ({len(got)} of {len(baseline)} chars)"
    if got.startswith(baseline):
        return f"extra text after the baseline's {len(baseline)} chars (duplicated tokens?)"
    at = next(i for i, (a, b) in enumerate(zip(baseline, got)) if a != b)
    return f"differs at char {at}: {baseline[at:at + 20]!r} vs {got[at:at + 20]!r}"


def count_identical(baselines: list[str], outputs: list[str | None]) -> tuple[int, list[str]]:
    """How many outputs equal their baseline; a line for each that does not (None: no output)."""
    same, differences = 0, []
    for i, (base, got) in enumerate(zip(baselines, outputs)):
        verdict = "no output" if got is None else compare_output(base, got)
        if verdict == "identical":
            same += 1
        else:
            differences.append(f"request {i}: {verdict}")
    return same, differences


def error_cell(errors: list[str]) -> str:
    """"-", or the count and the commonest error (with its count when others differ)."""
    if not errors:
        return "-"
    message, times = collections.Counter(errors).most_common(1)[0]
    message = message if len(message) <= ERROR_CELL else message[:ERROR_CELL - 3] + "..."
    return f"{len(errors)}: {message}" + (f" (x{times})" if times != len(errors) else "")


def table_rows(rows: list[Row]) -> list[list]:
    """The table's cells; no stall (a scenario without streams) is None: blank, the column stays numeric."""
    return [[r.scenario, r.requests, r.completed,
             "n/a" if r.identical is None else f"{r.identical}/{r.requests if r.compared is None else r.compared}",
             None if r.stall_s is None else f"{r.stall_s:.2f}", error_cell(r.errors), "ok" if r.ok else "FAIL"]
            for r in rows]


def format_report(rows: list[Row], title: str = "") -> str:
    """The table, then each scenario's notes and failed checks."""
    from bench.common.table import format_table
    out = [format_table(HEADERS, table_rows(rows), title)]
    for r in rows:
        lines = [*(f"  {n}" for n in r.notes), *(f"  FAILED: {f}" for f in r.failures)]
        if lines:
            out += [f"\n{r.scenario} ({r.seconds:.0f} s):", *lines]
    return "\n".join(out)
