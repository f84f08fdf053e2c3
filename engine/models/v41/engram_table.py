"""One Engram layer's table, kept in host memory and read row by row.

Released tables are FP8 e4m3 `[rows, dim]` with one e8m0 scale per row and 32 columns
(`[rows, dim / 32]`), about 94 GiB per layer: they never go to a GPU whole. Only the rows a step
reads are dequantized (value * scale, exact in fp32), in the caller's dtype.

With CUDA the table is pinned in place (cudaHostRegister: no copy into power-of-two pinned
blocks) and exposed to the GPU as a device-addressable view of host memory (unified addressing),
so a GPU gather reads just the requested rows over PCIe, with no host sync. If pinning or the view
is unavailable, rows are gathered on the host and copied over through a pinned staging buffer.
"""

from __future__ import annotations

import logging
import weakref

import torch

log = logging.getLogger(__name__)

SCALE_BLOCK = 32  # columns per e8m0 scale


class _DeviceView:
    """Describes registered host memory to `torch.as_tensor` via the CUDA array interface."""

    def __init__(self, host: torch.Tensor, owner: torch.Tensor):
        self.owner = owner  # torch keeps this object alive as long as the CUDA tensor: so the host bytes
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape), "typestr": "|u1", "data": (host.data_ptr(), False), "version": 3,
            "strides": None,
        }


class EngramTable:
    """Rows `[num_rows, dim]`: FP8 values + e8m0 scales (as released) or plain floating values."""

    def __init__(self, num_rows: int, dim: int):
        if dim % SCALE_BLOCK:
            raise ValueError(f"Engram head_dim {dim} must be a multiple of {SCALE_BLOCK}")
        self.num_rows, self.dim = num_rows, dim
        self.values: torch.Tensor | None = None  # uint8 bytes of FP8 values, or a floating tensor
        self.scales: torch.Tensor | None = None  # uint8 e8m0 exponents, or float32 scales
        self.pinned = False
        self._views: dict[torch.device, tuple[torch.Tensor, torch.Tensor | None]] = {}

    @property
    def loaded(self) -> bool:
        return self.values is not None

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    def load(self, values: torch.Tensor, scales: torch.Tensor | None = None) -> None:
        """values: FP8 e4m3 [rows, dim] with scales [rows, dim / 32] (e8m0, raw uint8 exponents, or
        float powers of two); or floating values with scales None. Copied into this table's own
        host memory only when it is pinned (CUDA present)."""
        if tuple(values.shape) != (self.num_rows, self.dim):
            raise ValueError(f"Engram table is {tuple(values.shape)}, expected {(self.num_rows, self.dim)}")
        if scales is None:
            if not values.is_floating_point() or values.dtype == torch.float8_e4m3fn:
                raise ValueError("an FP8 Engram table needs its scales")
            stored_values, stored_scales = values, None
        else:
            if values.dtype not in (torch.float8_e4m3fn, torch.uint8):
                raise ValueError(f"quantized Engram values must be float8_e4m3fn, got {values.dtype}")
            if tuple(scales.shape) != (self.num_rows, self.dim // SCALE_BLOCK):
                raise ValueError(f"Engram scales are {tuple(scales.shape)}, "
                                 f"expected {(self.num_rows, self.dim // SCALE_BLOCK)}")
            stored_values = values.view(torch.uint8)
            if scales.dtype in (torch.float8_e8m0fnu, torch.uint8):
                stored_scales = scales.view(torch.uint8)
            else:
                stored_scales = scales.float()
        self._views.clear()
        self.values, self.scales = self._host(stored_values), None if stored_scales is None else self._host(stored_scales)
        self.pinned = self._pin()

    def read(self, rows: torch.Tensor, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
        """rows: integer row ids of any shape [...] -> dequantized rows [..., dim] on `device`."""
        if self.values is None:
            raise RuntimeError("the Engram table is not loaded")
        device = torch.device(device)
        if device.type == "cuda" and self.pinned:  # the GPU reads the rows straight from host memory
            values, scales = self._device_view(device)
            picked = self._pick(values, scales, rows.to(device, torch.long))
        else:  # gather on the host; ship the raw rows (a quarter of fp32's bytes) to dequantize there
            picked = self._pick(self.values, self.scales, rows.to("cpu", torch.long))
            if device.type == "cuda":
                picked = tuple(None if t is None else t.pin_memory().to(device, non_blocking=True) for t in picked)
        return self._dequantize(*picked, dtype).reshape(*rows.shape, self.dim)

    def _pick(self, values, scales, rows) -> tuple[torch.Tensor, torch.Tensor | None]:
        flat = rows.reshape(-1)
        if flat.device.type == "cpu" and flat.numel() and (flat.min() < 0 or flat.max() >= self.num_rows):
            raise ValueError(f"Engram row id outside [0, {self.num_rows})")
        return values.index_select(0, flat), None if scales is None else scales.index_select(0, flat)

    @staticmethod
    def _dequantize(values: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        if scales is None:
            return values.to(dtype)
        scale = scales.view(torch.float8_e8m0fnu).float() if scales.dtype == torch.uint8 else scales
        return (values.view(torch.float8_e4m3fn).float() * scale.repeat_interleave(SCALE_BLOCK, dim=1)).to(dtype)

    # ---- host memory
    def _host(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach().to("cpu").contiguous()
        if not torch.cuda.is_available():
            return tensor
        own = torch.empty(tensor.shape, dtype=tensor.dtype)  # plain host memory that we may register
        own.copy_(tensor)
        return own

    def _pin(self) -> bool:
        if not torch.cuda.is_available():
            return False
        cudart = torch.cuda.cudart()
        for tensor in (self.values, self.scales):
            if tensor is None or tensor.is_pinned():
                continue
            result = cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
            if int(getattr(result, "value", result)) != 0:
                log.warning("cudaHostRegister of an Engram table failed (%s); rows go through staging", result)
                return False
            weakref.finalize(tensor, cudart.cudaHostUnregister, tensor.data_ptr())
        return True

    def _device_view(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        if device not in self._views:
            with torch.cuda.device(device):
                views = tuple(None if t is None else _device_alias(t, device) for t in (self.values, self.scales))
            self._views[device] = views
        return self._views[device]


def _device_alias(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor over the same (registered) host bytes; keeps `host` alive with it."""
    raw = host.view(torch.uint8)
    return torch.as_tensor(_DeviceView(raw, host), device=device).view(host.dtype)

