"""Fused GPU kernels (Triton) for the engine's hot paths, each beside a plain-torch reference.

The model code asks `use_kernels(tensor)` before taking a kernel path; the torch path it would
otherwise run is the reference the kernel is tested against. Modes (`EPD_KERNELS`, or `set_mode`):

  auto  (default) kernels for CUDA tensors when Triton imports; CPU tensors always take torch
  off   torch everywhere (the bench's torch-path baseline; a fallback if a kernel misbehaves)
  on    kernels for every tensor, CPU too: only meaningful under TRITON_INTERPRET=1 (tests)

Triton is the optional `gpu` extra (`pip install .[gpu]`); the CPU install never needs it.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

MODES = ("auto", "off", "on")
_mode = os.environ.get("EPD_KERNELS", "auto")
if _mode not in MODES:
    raise ValueError(f"EPD_KERNELS must be one of {MODES}, got {_mode!r}")


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means no kernels
        return False
    return True


def interpreting() -> bool:
    """Triton's CPU interpreter is on (tests without a GPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def mode() -> str:
    return _mode


def set_mode(value: str) -> None:
    global _mode
    if value not in MODES:
        raise ValueError(f"kernel mode must be one of {MODES}, got {value!r}")
    _mode = value


@contextlib.contextmanager
def kernel_mode(value: str):
    """Run a block with the given mode, restoring the previous one after."""
    previous = _mode
    set_mode(value)
    try:
        yield
    finally:
        set_mode(previous)


def use_kernels(tensor: torch.Tensor) -> bool:
    """Should an operation on `tensor` take its fused-kernel path?"""
    if _mode == "off" or not triton_available():
        return False
    if tensor.is_cuda:
        return True
    return _mode == "on" and interpreting()
