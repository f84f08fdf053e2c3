"""`epd up --keys DIR` of a small echo stack: every service runs with CURVE, workers register with
their hub, `epd status` finds the keys in state.json, a client without them is refused."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ops.keys_command import write_keys
from tests.helpers.test_helper_processes import REPO
from tests.helpers.test_helper_stack import free_port_base, pid_alive
from tests.ops.test_stack_commands import write_topology

pytestmark = pytest.mark.slow   # starts a stack of service processes


def epd(cwd: Path, *args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ops.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def env(tmp_path):
    plain = {k: v for k, v in os.environ.items() if k != "EPD_KEYS_DIR"}   # nothing but --keys gives CURVE
    env = {**plain, "EPD_RUN_ROOT": str(tmp_path / "runs"), "PYTHONPATH": str(REPO)}
    yield env
    state_path = tmp_path / "runs" / "current" / "state.json"
    if state_path.exists():   # whatever a failing test left running goes now
        state = json.loads(state_path.read_text())
        for pid in [state["supervisor_pid"], *(s["pid"] for s in state["services"])]:
            if pid and pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_up_with_keys_runs_every_service_with_curve(tmp_path, env):
    write_keys(tmp_path / "keys")
    topology = write_topology(tmp_path / "t.toml", free_port_base(3))   # a hub and two echo workers
    up = epd(tmp_path, "up", "--detach", "--topology", str(topology), "--keys", "keys", env=env)
    assert up.returncode == 0, up.stdout + up.stderr
    assert f"links: CURVE, keys {(tmp_path / 'keys').resolve()}" in up.stdout
    state = json.loads((tmp_path / "runs" / "current" / "state.json").read_text())
    assert {s["keys_dir"] for s in state["services"]} == {str((tmp_path / "keys").resolve())}

    status = epd(tmp_path, "status", "--json", env=env)   # no EPD_KEYS_DIR: the keys come from state.json
    assert status.returncode == 0, status.stdout + status.stderr
    services = {s["instance"]: s for s in json.loads(status.stdout)["services"]}
    assert services["hub-0"]["peers"] == "2/2"   # both workers registered over CURVE

    hub = services["hub-0"]["address"]
    refused = epd(tmp_path, "health", "--address", hub, "--timeout-s", "1", env=env)
    assert refused.returncode == 1 and "uses CURVE" in refused.stderr
    assert epd(tmp_path, "health", "--address", hub, "--keys", "keys", env=env).returncode == 0
    assert epd(tmp_path, "down", env=env).returncode == 0


def test_up_refuses_a_broken_keys_dir_before_starting_anything(tmp_path, env):
    write_keys(tmp_path / "keys")
    (tmp_path / "keys" / "client.key").unlink()
    result = epd(tmp_path, "up", "--detach", "--keys", "keys", env=env)
    assert result.returncode == 2
    assert f"{(tmp_path / 'keys' / 'client.key').resolve()}: missing" in result.stderr
    assert not (tmp_path / "runs").exists()
