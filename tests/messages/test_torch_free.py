"""The contract, the KV store library and the services that only route or store never load torch
(4 s and ~200 MB per process). Each import runs in a fresh interpreter: this one has torch already."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def modules_loaded_by(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running `code` (fails on any error)."""
    done = subprocess.run([sys.executable, "-c", f"{code}\nimport sys; print(' '.join(sys.modules))"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


@pytest.mark.parametrize("module", ["messages", "messages.prefix", "kvstore"])
def test_the_contract_and_the_kv_store_import_without_torch(module):
    assert "torch" not in modules_loaded_by(f"import {module}")


@pytest.mark.parametrize("kind", ["prefill_router", "decode_router", "swa_registry", "kv_writer"])
def test_routing_and_storage_services_import_without_torch(kind):
    loaded = modules_loaded_by(f"from services.catalog import resolve; resolve({kind!r})")
    assert "torch" not in loaded, f"the {kind} service loads torch"
