"""`VisionEncoder`: V4.1's vision tower, from request images to the embedding rows of their spans.

`preprocess` turns one image's bytes into patches (CPU, float32); `encode` runs a batch of images
through the ViT and the aligner together (each image attends only to its own patches) and returns,
per image, the rows of its whole span [grid.tokens, hidden]: learned START, aligned rows with a
learned NEWLINE after each row, learned END. The engine puts them where the span's tokens are.
Parameter names are the release's (`vision.*`, `aligner.*`, `image_start|newline|end`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from engine.models.v41.checkpoint import iter_vision_state_dict
from engine.models.v41.config import V41Config, load_v41_config
from engine.models.v41.vision.aligner import Aligner
from engine.models.v41.vision.preprocess import preprocess_image
from engine.models.v41.vision.span import span_rows
from engine.models.v41.vision.vit import VisionTransformer
from messages.images import ImageGrid, ImageInput, VisionSizing


class NoVisionEncoder(ValueError):
    """The model has no vision tower: a V4 model, or a V4.1 one with vision_config.num_hidden_layers 0."""


def has_vision_encoder(model_dir: str | Path) -> bool:
    """Whether the model directory's config.json is a V4.1 model with a vision tower."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    if "deepseek_v41" not in (raw.get("model_type"), text.get("model_type", "").removesuffix("_text")):
        return False
    return load_v41_config(Path(model_dir)).vision.enabled


class VisionEncoder(nn.Module):
    def __init__(self, config: V41Config):
        super().__init__()
        if not config.vision.enabled:
            raise NoVisionEncoder("this V4.1 config has no vision encoder (vision_config.num_hidden_layers is 0)")
        self.config = config.vision
        self.hidden_size = config.hidden_size
        self.sizing: VisionSizing = config.vision.sizing
        self.vision = VisionTransformer(config.vision)
        self.aligner = Aligner(config.vision, config.hidden_size)
        self.image_start = nn.Parameter(torch.zeros(config.hidden_size))
        self.image_newline = nn.Parameter(torch.zeros(config.hidden_size))
        self.image_end = nn.Parameter(torch.zeros(config.hidden_size))

    @classmethod
    def load(cls, model_dir: str | Path, device: str | torch.device = "cpu",
             dtype: torch.dtype = torch.float32) -> "VisionEncoder":
        """The vision tower of a V4.1 model directory; norms stay float32, the rest is `dtype`.
        NoVisionEncoder for a model without one."""
        if not has_vision_encoder(model_dir):
            raise NoVisionEncoder(f"{model_dir} has no vision encoder (not a DeepSeek V4.1 model with vision_config)")
        config = load_v41_config(Path(model_dir))
        with torch.device("meta"):
            encoder = cls(config)
        state = dict(iter_vision_state_dict(model_dir, device, dtype))
        encoder.load_state_dict(state, strict=True, assign=True)
        return encoder.eval()

    @property
    def device(self) -> torch.device:
        return self.image_start.device

    @property
    def dtype(self) -> torch.dtype:
        return self.image_start.dtype

    def preprocess(self, image: ImageInput) -> torch.Tensor:
        """Patches [vit_h * vit_w, 3, p, p] float32 on the CPU; ValueError on undecodable data."""
        return preprocess_image(image, self.sizing)

    @torch.no_grad()
    def encode(self, patches: Sequence[torch.Tensor], grids: Sequence[ImageGrid]) -> list[torch.Tensor]:
        """One [grid.tokens, hidden] tensor (the encoder's dtype and device) per image."""
        if len(patches) != len(grids):
            raise ValueError(f"{len(patches)} patch tensors for {len(grids)} grids")
        if not grids:
            return []
        p, ratio = self.config.patch_size, self.config.downsample_ratio
        for i, (image, grid) in enumerate(zip(patches, grids)):
            if (grid.llm_h, grid.llm_w) != (-(-grid.vit_h // ratio), -(-grid.vit_w // ratio)):
                raise ValueError(f"image {i}: grid {grid} does not fold {ratio}x{ratio}")
            if tuple(image.shape) != (grid.patches, 3, p, p):
                raise ValueError(f"image {i}: patches {tuple(image.shape)}, its grid needs "
                                 f"({grid.patches}, 3, {p}, {p})")
        vit_grids = [(grid.vit_h, grid.vit_w) for grid in grids]
        packed = torch.cat(list(patches)).to(device=self.device, dtype=self.dtype)
        cells = self.aligner(self.vision(packed, vit_grids), vit_grids)
        pieces = cells.split([grid.llm_h * grid.llm_w for grid in grids])
        return [span_rows(piece, grid, self.image_start, self.image_newline, self.image_end)
                for piece, grid in zip(pieces, grids)]
