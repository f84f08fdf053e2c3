"""The V4.1 vision aligner: fold the ViT grid `ratio` x `ratio` and project into the text model's width.

The grid is zero-padded on the bottom and right to whole cells; a cell's feature vector is ordered
(channel, row in cell, column in cell), as `F.unfold` orders it in the reference; cells are row-major.
Then Linear -> GELU (exact) -> Linear. Names are the release's (`aligner.w1`, `aligner.w2`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.v41.config import V41VisionConfig


def fold_cells(x: torch.Tensor, rows: int, cols: int, ratio: int) -> torch.Tensor:
    """x [rows*cols, C] (row-major patches) -> [ceil(rows/ratio) * ceil(cols/ratio), C * ratio * ratio]."""
    channels = x.shape[-1]
    grid = F.pad(x.view(rows, cols, channels), (0, 0, 0, -cols % ratio, 0, -rows % ratio))
    cells_h, cells_w = grid.shape[0] // ratio, grid.shape[1] // ratio
    cells = grid.view(cells_h, ratio, cells_w, ratio, channels).permute(0, 2, 4, 1, 3)
    return cells.reshape(cells_h * cells_w, channels * ratio * ratio)


class Aligner(nn.Module):
    def __init__(self, config: V41VisionConfig, text_hidden: int):
        super().__init__()
        self.ratio = config.downsample_ratio
        self.w1 = nn.Linear(config.hidden_size * self.ratio ** 2, text_hidden)
        self.w2 = nn.Linear(text_hidden, text_hidden)

    def forward(self, x: torch.Tensor, grids: Sequence[tuple[int, int]]) -> torch.Tensor:
        """ViT output [sum(h*w), dim] packed over images of (h, w) patches -> their language-model rows
        [sum(llm_h * llm_w), hidden], packed the same way (each image folded alone, projected together)."""
        pieces = x.split([rows * cols for rows, cols in grids])
        cells = torch.cat([fold_cells(piece, rows, cols, self.ratio) for piece, (rows, cols) in zip(pieces, grids)])
        return self.w2(F.gelu(self.w1(cells)))
