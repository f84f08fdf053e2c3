"""CURVE across real service processes: a worker registers with its hub over CURVE, `epd health`
needs the stack's keys (and says so without them), a broken keys dir exits at once naming the file."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ops.keys_command import write_keys
from tests.helpers.test_helper_processes import REPO, free_port, procs, tcp_config, wait_until  # noqa: F401

pytestmark = pytest.mark.slow   # starts service processes

EXIT_WITHIN_S = 10.0


@pytest.fixture
def keys_dir(tmp_path, monkeypatch):
    """One stack's keys; EPD_KEYS_DIR names them, so the test's status probes are CURVE clients."""
    write_keys(tmp_path / "keys")
    monkeypatch.setenv("EPD_KEYS_DIR", str(tmp_path / "keys"))
    return tmp_path / "keys"


def epd(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ops.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)


def test_a_worker_registers_with_its_hub_over_curve(procs, keys_dir):
    hub = procs(tcp_config("echo", "hub-0", keys_dir=str(keys_dir), heartbeat_s=0.5))
    hub.wait_running()
    worker = procs(tcp_config("echo", "worker-0", keys_dir=str(keys_dir), heartbeat_s=0.5, upstream=hub.address))
    worker.wait_running(upstream=True)
    wait_until(lambda: any(p.instance == "worker-0" and p.alive for p in hub.status().peers), 10,
               "worker-0 to register with the hub")


def test_health_needs_the_stacks_keys_and_says_so_without_them(procs, keys_dir):
    svc = procs(tcp_config("echo", "svc-0", keys_dir=str(keys_dir)))
    svc.wait_running()
    plain_env = {k: v for k, v in os.environ.items() if k != "EPD_KEYS_DIR"}

    ok = epd("health", "--address", svc.address, env={**plain_env, "EPD_KEYS_DIR": str(keys_dir)})
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == "svc-0: running"
    assert epd("health", "--address", svc.address, "--keys", str(keys_dir), env=plain_env).returncode == 0

    refused = epd("health", "--address", svc.address, "--timeout-s", "1", env=plain_env)
    assert refused.returncode == 1
    assert "uses CURVE and this client has no keys" in refused.stderr and "EPD_KEYS_DIR" in refused.stderr

    write_keys(keys_dir.parent / "other")   # another stack's keys: every key differs
    other = epd("health", "--address", svc.address, "--timeout-s", "1", "--keys", str(keys_dir.parent / "other"),
                env=plain_env)
    assert other.returncode == 1 and "handshake" in other.stderr and "server.key" in other.stderr


def test_health_with_a_broken_keys_dir_is_a_usage_error(tmp_path):
    result = epd("health", "--address", "tcp://127.0.0.1:1", "--keys", str(tmp_path / "absent"), env=dict(os.environ))
    assert result.returncode == 2 and str(tmp_path / "absent") in result.stderr


def test_a_service_with_a_broken_keys_dir_exits_at_once_naming_the_file(keys_dir):
    (keys_dir / "server.key_secret").unlink()
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "services.runtime.main"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "EPD_KIND": "echo", "EPD_INSTANCE": "svc-0",
                               "EPD_BIND": f"tcp://127.0.0.1:{free_port()}", "EPD_KEYS_DIR": str(keys_dir)},
                          timeout=EXIT_WITHIN_S)
    assert proc.returncode == 1
    assert f"{keys_dir / 'server.key_secret'}: missing" in proc.stderr
    assert '"event": "service.start_failed"' in proc.stdout and '"type": "KeysError"' in proc.stdout
    assert time.monotonic() - started < EXIT_WITHIN_S
