"""The seeded trace of `epd bench vision`: requests with small and large images arriving as a
Poisson process. Pure (no torch, no sockets): the simulation and the real-process run share it.

Sizes: a `small_share` of the images are small (a side near the sizing's minimum area, so V4.1's
min_pixels rule lifts them to its floor grid or just above), the rest large (a side up to the
token budget); aspect ratios 1:2 .. 2:1. Each image's cost is its planned grid's patches. Most
requests carry one image, some two or three.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from messages.images import ImageGrid, ImageTooLarge, VisionSizing, plan_image_grid

IMAGES_PER_REQUEST = ((1, 0.75), (2, 0.15), (3, 0.10))


@dataclass(slots=True, frozen=True)
class TraceImage:
    width: int
    height: int
    grid: ImageGrid

    @property
    def patches(self) -> int:
        return self.grid.patches


@dataclass(slots=True, frozen=True)
class TraceRequest:
    arrival_s: float               # since the trace's start
    images: tuple[TraceImage, ...]

    @property
    def patches(self) -> int:
        return sum(image.patches for image in self.images)


def _side_range(sizing: VisionSizing) -> tuple[int, int]:
    """Square sides in pixels: the floor (min_pixels) and the largest that fits the token budget."""
    low = max(sizing.patch_size, int(math.sqrt(sizing.min_pixels)))
    cell = sizing.patch_size * sizing.downsample_ratio
    cells = int(math.sqrt(sizing.max_image_tokens - 2))   # h * (w + 1) + 2 <= budget, square
    while cells > 1 and cells * (cells + 1) + 2 > sizing.max_image_tokens:
        cells -= 1
    return low, max(low + 1, cells * cell)


def draw_image(rng: random.Random, sizing: VisionSizing, small: bool) -> TraceImage:
    low, high = _side_range(sizing)
    split = low + (high - low) // 5   # small: the first fifth of the range of sides; large: the top half
    lo, hi = (low // 2, split) if small else ((low + high) // 2, high)
    while True:
        side = rng.randint(lo, hi)
        aspect = math.exp(rng.uniform(-math.log(2), math.log(2)))
        width, height = max(1, round(side * math.sqrt(aspect))), max(1, round(side / math.sqrt(aspect)))
        try:
            return TraceImage(width, height, plan_image_grid(width, height, sizing))
        except ImageTooLarge:
            continue


def mixed_trace(requests: int, rate_per_s: float, sizing: VisionSizing, seed: int = 0,
                small_share: float = 0.7) -> list[TraceRequest]:
    """`requests` requests at `rate_per_s` (Poisson): the same list for the same arguments."""
    if requests < 1 or rate_per_s <= 0:
        raise ValueError("requests must be >= 1 and rate_per_s > 0")
    rng = random.Random(seed)
    counts, weights = zip(*IMAGES_PER_REQUEST)
    out, now = [], 0.0
    for _ in range(requests):
        now += rng.expovariate(rate_per_s)
        n = rng.choices(counts, weights)[0]
        out.append(TraceRequest(now, tuple(draw_image(rng, sizing, rng.random() < small_share) for _ in range(n))))
    return out


def mean_patches_per_request(sizing: VisionSizing, seed: int = 0, samples: int = 2000) -> float:
    """The trace's expected patches per request (a large sample of the same distribution)."""
    trace = mixed_trace(samples, 1.0, sizing, seed=seed + 1)
    return sum(r.patches for r in trace) / len(trace)


def spread(trace: list[TraceRequest]) -> tuple[int, int]:
    """The smallest and largest image's patches."""
    patches = [image.patches for r in trace for image in r.images]
    return min(patches), max(patches)
