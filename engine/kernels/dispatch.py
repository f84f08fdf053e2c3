"""The one table that picks the torch or the fused-kernel implementation of each op.

`KERNELS` names, per op, where its Triton kernel lives. Model code asks `kernel(op, tensor)`: the
kernel function when kernels run for `tensor` (`use_kernels`: `EPD_KERNELS` and the tensor's device),
else None, and the caller then runs its own torch path, the reference the kernel is tested against
(`takes_kernel` for a branch into a kernel-path helper, which calls `load_kernel`).
Kernel modules are imported on first use only: they import Triton, which a CPU install lacks.

`pinned(ops, on)` turns single ops on or off whatever the mode (tests comparing one family of
kernels against the torch path while everything else stays put).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterable

import torch

from engine.kernels import use_kernels

KERNELS: dict[str, tuple[str, str]] = {   # op -> (module, function) of its kernel
    "rms_norm": ("engine.kernels.rope_norm", "rms_norm"),   # weighted or unweighted RMS norm
    "rope": ("engine.kernels.rope_norm", "rope"),   # rotary embedding (V4, and V4.1 given cos/sin)
    "norm_rope": ("engine.kernels.rope_norm", "norm_rope"),   # RMS norm then rotary, one pass
    "masked_attention": ("engine.kernels.sparse_attention", "masked_attention"),   # V4 dense-mask + sink
    "sparse_attention": ("engine.kernels.sparse_attention", "sparse_attention"),   # V4 window + top-k entries
    "index_scores": ("engine.kernels.index_scores", "index_scores"),   # V4 CSA indexer scores
    "moe": ("engine.kernels.moe_gemm", "moe_forward"),   # routed experts on packed weights
    "quant_linear": ("engine.kernels.quant_linear", "quant_linear"),   # FP8 / MXFP4 weight-only linear
    "hc_v4_site": ("engine.kernels.mhc", "hc_v4_site"),   # V4 mHC pre/post/comb of one site
    "hc_v4_head": ("engine.kernels.mhc", "hc_v4_head"),   # V4 mHC head collapse
    "hc_v41_site": ("engine.kernels.mhc", "hc_v41_site"),   # V4.1 single-pass mHC site
    "hc_merge": ("engine.kernels.mhc_merge", "hc_merge"),   # mHC stream update after a block
    "hc_collapse": ("engine.kernels.mhc_merge", "hc_collapse"),   # V4.1 streams -> one hidden row
}

_pins: dict[str, bool] = {}


def kernel(op: str, tensor: torch.Tensor) -> Callable | None:
    """`op`'s kernel if `tensor` takes the kernel path, else None (run the torch path)."""
    if op not in KERNELS:
        raise KeyError(f"no kernel op {op!r}; the table has {sorted(KERNELS)}")
    on = _pins[op] if op in _pins else use_kernels(tensor)
    return load_kernel(op) if on else None


def takes_kernel(op: str, tensor: torch.Tensor) -> bool:
    """Whether `op` on `tensor` takes its kernel path (for a caller that branches to a helper)."""
    return kernel(op, tensor) is not None


@functools.lru_cache(maxsize=None)
def load_kernel(op: str) -> Callable:
    """`op`'s kernel function itself, for code already on the kernel path."""
    module, name = KERNELS[op]
    return vars(importlib.import_module(module))[name]


@contextlib.contextmanager
def pinned(ops: Iterable[str], on: bool):
    """Within the block, `ops` take (on) or skip (off) their kernels whatever the mode."""
    ops = list(ops)
    unknown = [op for op in ops if op not in KERNELS]
    if unknown:
        raise KeyError(f"no kernel ops {unknown}")
    previous = {op: _pins[op] for op in ops if op in _pins}
    _pins.update(dict.fromkeys(ops, on))
    try:
        yield
    finally:
        for op in ops:
            _pins.pop(op, None)
        _pins.update(previous)
