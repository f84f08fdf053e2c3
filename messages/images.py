"""Images in a prompt: V4.1's sizing rule and the image record every service passes along.

The gateway decodes an image, plans its grid here and writes its span into the prompt; the vision
worker resizes it to that same grid and encodes it; the engine merges the span's embeddings. One
function decides the grid, so the token count a client is billed is the count the encoder fills.

V4.1's rule (NeMo Automodel `deepseek_v41/processing.py::_plan_image_grid`, vLLM
`deepseek_v41/common/mm_preprocess.py`): widen a too-narrow image to `max_wh_ratio`, raise the area
to `min_pixels`, round each side up to whole patches; the language model sees the ViT grid folded
`downsample_ratio` x `downsample_ratio`, one token per cell plus a newline per row and a start and
an end: tokens = llm_h * (llm_w + 1) + 2. Over `max_image_tokens` the image shrinks to fit.

Pure standard library: the gateway and routers import this and never load the engine.
"""
from __future__ import annotations

import math

import msgspec


class VisionSizing(msgspec.Struct, frozen=True, gc=False):
    """The checkpoint's `vision_config` fields that size an image (released V4.1 defaults)."""

    patch_size: int = 14
    downsample_ratio: int = 3
    max_image_tokens: int = 1024
    min_pixels: int = 295936
    max_wh_ratio: float | None = None

    @classmethod
    def from_config(cls, config: dict) -> "VisionSizing":
        """From a model's config.json (the nested `vision_config`, defaults for missing keys)."""
        vision = config.get("vision_config") or {}
        fields = {name: vision[name] for name in cls.__struct_fields__ if vision.get(name) is not None}
        return cls(**fields)


class ImageGrid(msgspec.Struct, array_like=True, frozen=True, gc=False):
    height: int       # pixels after resizing (whole patches)
    width: int
    vit_h: int        # ViT patch rows and columns
    vit_w: int
    llm_h: int        # language-model rows and columns (the ViT grid folded downsample_ratio x downsample_ratio)
    llm_w: int

    @property
    def tokens(self) -> int:
        """The span's length in the prompt: [START, (IMAGE x llm_w, NEWLINE) x llm_h, END]."""
        return self.llm_h * (self.llm_w + 1) + 2

    @property
    def patches(self) -> int:
        """ViT patches: what the vision balancer weighs an image by."""
        return self.vit_h * self.vit_w


class ImageTooLarge(ValueError):
    """The image cannot fit the configured token budget (e.g. an extreme aspect ratio)."""


def plan_image_grid(width: int, height: int, sizing: VisionSizing = VisionSizing()) -> ImageGrid:
    if width <= 0 or height <= 0:
        raise ValueError(f"image dimensions must be positive, got {width}x{height}")
    if sizing.max_image_tokens < 4:
        raise ValueError("max_image_tokens must be at least 4")
    patch, fold, budget = sizing.patch_size, sizing.downsample_ratio, sizing.max_image_tokens
    logical_w: float = width
    logical_h: float = height
    if sizing.max_wh_ratio is not None and width > height * sizing.max_wh_ratio:
        logical_w = height * sizing.max_wh_ratio
    if logical_w * logical_h < sizing.min_pixels:
        scale = (sizing.min_pixels / (logical_w * logical_h)) ** 0.5
        logical_w, logical_h = int(logical_w * scale), int(logical_h * scale)
    best_w = math.ceil(logical_w / patch) * patch
    best_h = math.ceil(logical_h / patch) * patch
    llm_h, llm_w = math.ceil(best_h // patch / fold), math.ceil(best_w // patch / fold)
    if llm_h * (llm_w + 1) + 2 > budget:
        # shrink to the largest whole-cell grid under the budget, keeping the aspect ratio
        aspect = logical_h / logical_w
        max_w = math.sqrt((budget - 2) / aspect + 0.25) - 0.5
        max_h = max_w * aspect
        cell = patch * fold
        if max_w < 1:
            best_h, best_w = (budget - 2) // 2 * cell, cell
        elif max_h < 1:
            best_h, best_w = cell, (budget - 3) * cell
        else:
            beta = min(math.floor(max_w) * cell / logical_w, math.floor(max_h) * cell / logical_h)
            best_h = math.floor(logical_h * beta / patch) * patch
            best_w = math.floor(logical_w * beta / patch) * patch
        llm_h, llm_w = math.ceil(best_h // patch / fold), math.ceil(best_w // patch / fold)
    if min(best_h, best_w) <= 0 or llm_h * (llm_w + 1) + 2 > budget:
        raise ImageTooLarge(f"a {width}x{height} image cannot fit {budget} image tokens")
    return ImageGrid(best_h, best_w, best_h // patch, best_w // patch, llm_h, llm_w)


class ImageInput(msgspec.Struct, array_like=True, gc=False):
    """One image of a request, as the gateway resolved it: travels gateway -> prefill worker -> vision worker."""

    digest: bytes      # sha256 of `data`: equal images share prefix blocks, different ones never do
    data: bytes        # the encoded image as fetched (PNG, JPEG, WebP, GIF first frame, ...)
    width: int         # decoded size in pixels
    height: int
    grid: ImageGrid
    start: int = -1    # position of the span's first token (START) in the prompt

    @property
    def end(self) -> int:
        """One past the span's last token."""
        return self.start + self.grid.tokens


def split_image_data(images: list[ImageInput]) -> tuple[list[ImageInput], list[bytes]]:
    """The images without their bytes (for a message body) and the bytes as buffer frames, in order.
    Image bytes never ride in a MessagePack header: it is capped (8 MiB) and an image may be larger."""
    bare = [ImageInput(img.digest, b"", img.width, img.height, img.grid, img.start) for img in images]
    return bare, [img.data for img in images]


def join_image_data(images: list[ImageInput], envelope, first: int = 0) -> list[ImageInput]:
    """`images` with their bytes put back from the envelope's buffer frames first, first + 1, ...
    (zero-copy views); MalformedFrame when the frames do not match."""
    from messages.errors import MalformedFrame
    if len(envelope.buffers) < first + len(images):
        raise MalformedFrame(f"{len(images)} images came with {len(envelope.buffers) - first} frames",
                             request_id=envelope.request_id)
    out = []
    for i, image in enumerate(images):
        desc, view = envelope.frame(first + i)
        if desc.dtype != "uint8" or len(desc.shape) != 1:
            raise MalformedFrame(f"image {i}'s frame is {desc.dtype}{list(desc.shape)}, not bytes",
                                 request_id=envelope.request_id)
        out.append(ImageInput(image.digest, view, image.width, image.height, image.grid, image.start))
    return out
