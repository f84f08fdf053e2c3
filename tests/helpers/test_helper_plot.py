"""Test-only checks of a plot: what a figure shows (its lines' points), and a PNG file (its signature
and its header's size)."""
from __future__ import annotations

import struct
from pathlib import Path

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) of the PNG at `path`; fails the test when it is not one."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR", f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 0 and height > 0 and len(data) > 1000, (width, height, len(data))
    return width, height


def lines_of(fig) -> list[dict[str, list[tuple[float, float]]]]:
    """What each axes of `fig` shows: label -> its (x, y) points."""
    return [{line.get_label(): list(zip(map(float, line.get_xdata()), map(float, line.get_ydata())))
             for line in ax.get_lines()} for ax in fig.axes]
