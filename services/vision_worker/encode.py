"""One batch through the encoder, on the encoder's thread: check, preprocess, encode, bring the rows
to the CPU. Every image gets an answer: its span rows, or a typed failure; nothing raises.

Checks before any pixel is touched: the bytes are the ones the digest names (the digest keys the
prompt's block hashes: rows filed under another image's digest would poison the prefix cache), and
the grid is this encoder's plan for the image's size (the span the gateway wrote into the prompt
has exactly grid.tokens positions).
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from messages.errors import ErrorCode
from messages.images import plan_image_grid


@dataclass(slots=True)
class Failure:
    code: int
    message: str


@dataclass(slots=True)
class BatchResult:
    outputs: list          # per image: a CPU tensor [grid.tokens, hidden], or a Failure
    encode_s: float        # the encoder's time (preprocessing excluded)
    preprocess_s: float


def check_image(image, sizing) -> Failure | None:
    if hashlib.sha256(image.data).digest() != bytes(image.digest):
        return Failure(ErrorCode.INVALID_REQUEST, "the image's bytes do not match its digest")
    try:
        planned = plan_image_grid(image.width, image.height, sizing)
    except ValueError as exc:
        return Failure(ErrorCode.INVALID_REQUEST, f"the image cannot be planned: {exc}")
    if planned != image.grid:
        return Failure(ErrorCode.INVALID_REQUEST, f"the image's grid {image.grid} is not this encoder's plan "
                                                  f"for {image.width}x{image.height} ({planned})")
    return None


def encode_batch(encoder, images: list) -> BatchResult:
    """`images`: ImageInput with their bytes. Runs on the encoder's thread."""
    started = time.perf_counter()
    outputs: list = [None] * len(images)
    patches, grids, slots = [], [], []
    for i, image in enumerate(images):
        failure = check_image(image, encoder.sizing)
        if failure is None:
            try:
                patches.append(encoder.preprocess(image))
                grids.append(image.grid)
                slots.append(i)
            except ValueError as exc:   # undecodable bytes: the contract's error for a bad image
                failure = Failure(ErrorCode.INVALID_REQUEST, f"the image cannot be decoded: {exc}")
            except Exception as exc:    # noqa: BLE001 - one image's bug must not fail the batch
                failure = Failure(ErrorCode.INTERNAL, f"preprocessing failed: {exc!r}")
        outputs[i] = failure
    encoding = time.perf_counter()
    if slots:
        try:
            rows = encoder.encode(patches, grids)
            for i, t in zip(slots, rows, strict=True):
                outputs[i] = t.detach().to("cpu").contiguous()
                grid = images[i].grid
                if outputs[i].ndim != 2 or outputs[i].shape[0] != grid.tokens:
                    outputs[i] = Failure(ErrorCode.INTERNAL, f"the encoder gave {list(t.shape)} rows for a span "
                                                             f"of {grid.tokens} tokens")
        except Exception as exc:   # noqa: BLE001 - out of memory, a bug: the batch fails, the worker serves on
            for i in slots:
                outputs[i] = Failure(ErrorCode.INTERNAL, f"encoding failed: {exc!r}")
    done = time.perf_counter()
    return BatchResult(outputs, done - encoding, encoding - started)


def warm_up(encoder) -> float:
    """One encode of the smallest image the sizing plans (zero pixels), before the worker reports
    RUNNING: lazy initialisation (kernels, allocator pools) is not paid by the first request."""
    import torch
    started = time.perf_counter()
    sizing = encoder.sizing
    grid = plan_image_grid(sizing.patch_size, sizing.patch_size, sizing)
    p = sizing.patch_size
    encoder.encode([torch.zeros(grid.patches, 3, p, p)], [grid])
    return time.perf_counter() - started
