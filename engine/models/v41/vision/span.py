"""An image's span in the prompt: [START, (IMAGE x llm_w, NEWLINE) x llm_h, END], row-major.

The IMAGE rows are the aligner's; START, NEWLINE and END are the checkpoint's learned vectors
(`image_start`, `image_newline`, `image_end`).
"""

from __future__ import annotations

import torch

from messages.images import ImageGrid


def span_rows(cells: torch.Tensor, grid: ImageGrid, start: torch.Tensor, newline: torch.Tensor,
              end: torch.Tensor) -> torch.Tensor:
    """cells [llm_h * llm_w, hidden] (row-major) -> the span's rows [grid.tokens, hidden]."""
    hidden = cells.shape[-1]
    if cells.shape[0] != grid.llm_h * grid.llm_w:
        raise ValueError(f"{cells.shape[0]} aligned rows for a {grid.llm_h}x{grid.llm_w} grid")
    rows = cells.view(grid.llm_h, grid.llm_w, hidden)
    newlines = newline.to(cells.dtype).expand(grid.llm_h, 1, hidden)
    body = torch.cat([rows, newlines], dim=1).view(-1, hidden)
    return torch.cat([start.to(cells.dtype)[None], body, end.to(cells.dtype)[None]])
