"""PNG figures for `epd bench ... --plot FILE`.

matplotlib's object API (Figure, no pyplot): no global state and no display, and a PNG is drawn
by the Agg renderer. Imported only when a plot is asked for, so `epd --help` stays fast.
"""
from __future__ import annotations

from pathlib import Path

PANEL_SIZE = (6.4, 4.6)   # inches per panel
DPI = 110


def figure(panels: int, title: str):
    """A figure of `panels` side-by-side axes, and the axes."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(PANEL_SIZE[0] * panels, PANEL_SIZE[1]), layout="constrained")
    axes = fig.subplots(1, panels, squeeze=False)[0]
    fig.suptitle(title, fontsize=10)
    return fig, list(axes)


def save_png(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=DPI)
    return path


def draw_series(ax, series: dict[str, list[tuple[float, float]]], styles: dict[str, str] | None = None,
                integer_x: bool = False) -> None:
    """One line per named series of (x, y) points; empty series are left out. `integer_x`: ticks only
    at whole numbers (rounds, streams)."""
    if integer_x:
        from matplotlib.ticker import MaxNLocator
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for label, points in series.items():
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, (styles or {}).get(label, "o-"), label=label)
    ax.grid(True, alpha=0.3)
    if any(series.values()):
        ax.legend(fontsize=8)

