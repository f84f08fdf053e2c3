"""Shared output of every `epd bench`: aligned text tables, the machine it ran on, JSON results."""
from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from typing import Any, Iterable, Sequence


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], title: str = "") -> str:
    """Columns padded to their widest cell; numbers right-aligned, text left-aligned."""
    cells = [[_cell(v) for v in row] for row in rows]
    numeric = [all(_is_number(row[i]) for row in cells if row[i]) for i in range(len(headers))]
    widths = [max([len(h), *(len(row[i]) for row in cells)]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric)).rstrip()

    out = [title] if title else []
    out += [line(headers), line(["-" * w for w in widths]), *(line(row) for row in cells)]
    return "\n".join(out)


def print_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], title: str = "", stream=None) -> None:
    print(format_table(headers, rows, title), file=stream or sys.stdout, flush=True)


def machine() -> dict[str, Any]:
    """What the numbers depend on: CPU model and count, OS, Python."""
    cpu_model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for text in f:
                if text.startswith("model name"):
                    cpu_model = text.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu_model": cpu_model or platform.processor() or "unknown",
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def write_json(path: str, bench: str, results: dict[str, Any]) -> dict[str, Any]:
    """Write `results` with the bench name, the date (UTC, ISO 8601) and the machine; returns the document."""
    doc = {"bench": bench, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": machine(), **results}
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    return doc



def ratio(a: float | None, b: float | None) -> float | None:
    """a / b rounded, or None when either is missing (or b is 0)."""
    return None if a is None or not b else round(a / b, 3)


def times(value: float | None) -> str:
    """A ratio as a table cell: "1.23x", or empty."""
    return "" if value is None else f"{value:.2f}x"


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 2)

def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _is_number(text: str) -> bool:
    try:
        float(text.replace(",", "").rstrip("x"))
    except ValueError:
        return False
    return True
