"""Test-only: whole stacks as real processes (`epd up --detach` / `epd down`) at free ports, and
the small process checks the stack tests share."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ops.ports import free_port_base  # noqa: F401 - the stack tests import it from here
from ops.topology import load_topology
from tests.helpers.test_helper_processes import REPO


def link_model(cwd: Path, model_dir: Path) -> None:
    """Make `cwd/.epd/models/<name>` (the topologies' relative model path) point at model_dir."""
    target = cwd / ".epd" / "models" / model_dir.name
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists():
        target.symlink_to(model_dir)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0] != "Z"


def up_stack(root: Path, topology: str, tiny_model_dir: Path) -> dict:
    """`epd up --detach` of an embedded topology at free ports under `root`; the stack's details."""
    env = {**os.environ, "EPD_RUN_ROOT": str(root / "runs"), "PYTHONPATH": str(REPO)}
    link_model(root, tiny_model_dir)
    base = free_port_base(len(load_topology(topology).instances()))
    http_port = free_port_base(1, offset=0)
    model = str(Path(".epd/models") / tiny_model_dir.name)   # served under the directory's name
    up = subprocess.run([sys.executable, "-m", "ops.cli", "up", "--detach", "--topology", topology,
                         "--port-base", str(base), "--http-port", str(http_port), "--model", model],
                        cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr
    state = json.loads((root / "runs/current/state.json").read_text())
    return {"url": f"http://127.0.0.1:{http_port}", "state": state, "root": root, "env": env}


def down_stack(stack: dict) -> None:
    """`epd down`, then check that no process of the stack is left."""
    subprocess.run([sys.executable, "-m", "ops.cli", "down"], cwd=stack["root"], env=stack["env"],
                   capture_output=True, timeout=120)
    state = stack["state"]
    for pid in [state["supervisor_pid"], *(s["pid"] for s in state["services"])]:
        assert not pid_alive(pid), "epd down left a process behind"
