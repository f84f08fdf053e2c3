"""Stacks for the E/P/D worker tests: the `epd` topology and the `unified` one, as real processes
started by `epd up --detach` on the session's tiny model (random weights, real tokenizer)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from tests.conftest import link_model
from tests.helpers.test_helper_processes import REPO
from tests.ops.test_stack_commands import free_port_base, pid_alive

EPD_SERVICES = 7


def epd_topology_at(port_base: int) -> str:
    """ops/topologies/epd.toml with its fixed peer addresses (slot i = port 5600 + i) moved to port_base."""
    text = (resources.files("ops.topologies") / "epd.toml").read_text()
    return re.sub(r"tcp://127\.0\.0\.1:(56\d\d)", lambda m: f"tcp://127.0.0.1:{port_base + int(m.group(1)) - 5600}",
                  text)


def _up(root: Path, topology: str, count: int, tiny_model_dir: Path):
    env = {**os.environ, "EPD_RUN_ROOT": str(root / "runs"), "PYTHONPATH": str(REPO)}
    link_model(root, tiny_model_dir)
    base = free_port_base(count)
    http_port = free_port_base(1, offset=0)
    if topology == "epd":
        path = root / "epd.toml"
        path.write_text(epd_topology_at(base))
        topology = str(path)
    up = subprocess.run([sys.executable, "-m", "ops.cli", "up", "--detach", "--topology", topology,
                         "--port-base", str(base), "--http-port", str(http_port)],
                        cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr
    state = json.loads((root / "runs/current/state.json").read_text())
    return {"url": f"http://127.0.0.1:{http_port}", "state": state, "root": root, "env": env}


def _down(stack) -> None:
    subprocess.run([sys.executable, "-m", "ops.cli", "down"], cwd=stack["root"], env=stack["env"],
                   capture_output=True, timeout=120)
    state = stack["state"]
    for pid in [state["supervisor_pid"], *(s["pid"] for s in state["services"])]:
        assert not pid_alive(pid), "epd down left a process behind"


@pytest.fixture(scope="package")
def epd_stack(tmp_path_factory, tiny_model_dir):
    stack = _up(tmp_path_factory.mktemp("epd"), "epd", EPD_SERVICES, tiny_model_dir)
    yield stack
    _down(stack)


@pytest.fixture(scope="package")
def unified_stack(tmp_path_factory, tiny_model_dir):
    stack = _up(tmp_path_factory.mktemp("unified"), "unified", 2, tiny_model_dir)
    yield stack
    _down(stack)
