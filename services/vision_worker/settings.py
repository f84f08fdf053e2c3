"""A vision worker's settings (ServiceConfig.settings), apart from the service so that `epd up` can
check them before it starts anything without importing torch."""
from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(slots=True, frozen=True)
class VisionWorkerSettings:
    model_dir: str = ""                # a V4.1 checkpoint with its vision encoder (vision.*, aligner.*, image_*)
    device: str = "cpu"
    dtype: str = "float32"             # the encoder's dtype, and the rows' on the wire
    max_batch_patches: int = 16384     # patches in one encoder batch (an image larger than this runs alone)
    max_queue_patches: int = 1 << 20   # patches queued here at most; beyond it VisionEncode is OVERLOADED
    torch_threads: int = 0             # CPU threads of the encoder's torch ops (0: torch's default)
    warmup: bool = True                # one encode of a blank image before reporting RUNNING

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise ValueError("model_dir is required (the checkpoint holding the vision encoder)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.max_batch_patches < 1 or self.max_queue_patches < 1 or self.torch_threads < 0:
            raise ValueError("max_batch_patches and max_queue_patches must be >= 1, torch_threads >= 0")
