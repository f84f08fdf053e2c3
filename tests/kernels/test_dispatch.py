"""The kernel table (engine.kernels.dispatch): it names real kernels, it follows EPD_KERNELS' modes and
the pins, and it is the only way model code reaches a kernel. Runs without Triton: nothing here
imports a kernel module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from engine.kernels import dispatch, kernel_mode
from engine.kernels.dispatch import KERNELS, kernel, pinned, takes_kernel

REPO = Path(__file__).resolve().parents[2]


def _top_level_functions(module: str) -> set[str]:
    path = REPO / (module.replace(".", "/") + ".py")
    return {node.name for node in ast.parse(path.read_text()).body if isinstance(node, ast.FunctionDef)}


def test_every_op_names_a_function_its_kernel_module_defines():
    missing = [f"{op}: {module}.{name}" for op, (module, name) in KERNELS.items()
               if name not in _top_level_functions(module)]
    assert missing == []


def test_an_unknown_op_is_an_error_naming_it():
    with pytest.raises(KeyError, match="no kernel op 'rmsnorm'"):
        kernel("rmsnorm", torch.zeros(1))
    with pytest.raises(KeyError, match="rmsnorm"):
        with pinned(["rmsnorm"], True):
            pass


def test_the_mode_decides_unless_an_op_is_pinned(monkeypatch):
    loaded = []
    monkeypatch.setattr(dispatch, "load_kernel", lambda op: loaded.append(op) or op)
    x = torch.zeros(2)
    with kernel_mode("off"):
        assert kernel("rms_norm", x) is None and not takes_kernel("rope", x)
        with pinned(["rms_norm"], True):
            assert kernel("rms_norm", x) == "rms_norm" and kernel("rope", x) is None
        assert kernel("rms_norm", x) is None   # the pin ends with its block
    monkeypatch.setattr(dispatch, "use_kernels", lambda tensor: True)
    assert kernel("moe", x) == "moe"
    with pinned(["moe"], False), pinned(["moe", "rope"], True):
        assert kernel("moe", x) == "moe" and kernel("rope", x) == "rope"   # the inner pin wins
    with pinned(["moe"], False):
        assert kernel("moe", x) is None
    assert loaded == ["rms_norm", "moe", "moe", "rope"]


def test_model_code_reaches_kernels_only_through_the_table():
    """No `use_kernels` test or kernel-module import outside engine/kernels: one table decides."""
    found = []
    for path in sorted((REPO / "engine").rglob("*.py")):
        relative = path.relative_to(REPO).as_posix()
        if relative.startswith("engine/kernels/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            bad = [n for n in names if n.startswith("engine.kernels") and n not in (
                "engine.kernels.dispatch", *(f"engine.kernels.dispatch.{f}" for f in dir(dispatch)))]
            if bad:
                found.append(f"{relative}:{node.lineno}: {bad}")
    assert found == []
