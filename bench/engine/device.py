"""Device facts and timing helpers for `epd bench engine`: copy and matmul rates, syncs, memory."""
from __future__ import annotations

import gc
import time


def measure_rates(device, dtype) -> dict:
    """Copy rate (bytes read + written per second, one large tensor copy) and matmul FLOP/s."""
    import torch
    nbytes = (2 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy_s = _best_time(lambda: dst.copy_(src), device, repeats=5)
    del src, dst
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    mm_s = _best_time(lambda: a @ b, device, repeats=5)
    del a, b
    _free(device)
    return {"copy_bytes": nbytes, "copy_s": copy_s, "copy_bytes_per_s": 2 * nbytes / copy_s,
            "matmul_n": n, "matmul_s": mm_s, "matmul_flops_per_s": 2 * n**3 / mm_s}


def _best_time(fn, device, repeats: int) -> float:
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def _is_oom(exc: BaseException) -> bool:
    import torch
    if isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device) -> None:
    import torch
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _reset_peak(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device):
    import torch
    if device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2)


def _device_name(device) -> str:
    import torch
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from bench.common.table import machine
    return f"{machine()['cpu_model']} ({torch.get_num_threads()} threads)"


def _transformers_version() -> str | None:
    try:
        from importlib.metadata import version
        return version("transformers")
    except Exception:  # noqa: BLE001
        return None


def _host_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
