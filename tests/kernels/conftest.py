"""Kernel tests run where Triton can run them: on a CUDA GPU, or on the CPU under TRITON_INTERPRET=1
(set before Python starts: Triton reads it at import). Elsewhere (CI: no GPU, no Triton) they skip."""

import pytest
import torch

from engine.kernels import interpreting, kernel_mode, triton_available


def kernel_device() -> str | None:
    if not triton_available():
        return None
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if interpreting() else None


@pytest.fixture
def device():
    """The device kernel tests run on; kernels forced on for CPU tensors under the interpreter."""
    where = kernel_device()
    if where is None:
        pytest.skip("needs Triton on a CUDA GPU, or Triton's CPU interpreter (TRITON_INTERPRET=1): the `gpu` extra")
    with kernel_mode("on" if where == "cpu" else "auto"):
        yield torch.device(where)
