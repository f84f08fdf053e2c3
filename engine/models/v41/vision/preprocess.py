"""An image's bytes -> the ViT's patches, as the reference prepares them (NeMo `_preprocess_image`).

Decode with Pillow and convert to RGB; an image at least `max_wh_ratio` times wider than tall is
stretched to the planned size, any other is scaled to fit inside it keeping its aspect ratio and
centred on gray (127, 127, 127) (`ImageOps.pad`, bicubic). Pixels go to [-1, 1] and are rounded to
bfloat16 as the reference rounds them (its patches are bf16); they come back as float32 holding
those values, so an fp32 encoder sees exactly the reference's inputs.
"""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image, ImageOps

from messages.images import ImageGrid, ImageInput, VisionSizing, plan_image_grid

GRAY = (127, 127, 127)


def decode_rgb(data: bytes) -> Image.Image:
    """The image's first frame in RGB; ValueError for anything Pillow cannot decode."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as error:
        raise ValueError(f"undecodable image ({len(data)} bytes): {error}") from error


def fit_to_grid(image: Image.Image, grid: ImageGrid, sizing: VisionSizing) -> Image.Image:
    """The RGB image at the grid's pixel size (grid.width x grid.height)."""
    size = (grid.width, grid.height)
    if sizing.max_wh_ratio is not None and image.width >= sizing.max_wh_ratio * image.height:
        return image.resize(size)
    return ImageOps.pad(image, size, color=GRAY)


def to_patches(image: Image.Image, grid: ImageGrid, patch: int) -> torch.Tensor:
    """[vit_h * vit_w, 3, patch, patch] float32 in [-1, 1] (bf16 values), row-major patches."""
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32).copy()).permute(2, 0, 1) / 255
    pixels = ((pixels - 0.5) / 0.5).to(torch.bfloat16).float()
    return (pixels.reshape(3, grid.vit_h, patch, grid.vit_w, patch).permute(1, 3, 0, 2, 4)
            .reshape(grid.vit_h * grid.vit_w, 3, patch, patch))


def preprocess_image(image: ImageInput, sizing: VisionSizing) -> torch.Tensor:
    """The patches of one request image. Its decoded size must be the one the gateway recorded and its
    grid the one `sizing` plans for that size (the prompt's span was written for that grid)."""
    decoded = decode_rgb(image.data)
    if (decoded.width, decoded.height) != (image.width, image.height):
        raise ValueError(f"image decodes to {decoded.width}x{decoded.height}, "
                         f"the request says {image.width}x{image.height}")
    planned = plan_image_grid(decoded.width, decoded.height, sizing)
    if planned != image.grid:
        raise ValueError(f"image grid {image.grid} is not this encoder's plan {planned} "
                         f"for a {decoded.width}x{decoded.height} image")
    return to_patches(fit_to_grid(decoded, planned, sizing), planned, sizing.patch_size)
