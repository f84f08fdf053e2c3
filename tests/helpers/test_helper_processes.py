"""Test-only helpers: start service processes over real sockets and wait for them without sleeping."""
from __future__ import annotations

import pytest

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from messages.control import ServiceState
from ops.control_client import query_status
from services.runtime.config import ServiceConfig

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.05):
    """Poll `predicate` until it returns a truthy value; fail the test with `what` on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


class ServiceProcess:
    """One `epd serve` process with its log captured; `stop()` kills it if still alive."""

    def __init__(self, config: ServiceConfig, log_dir: Path):
        self.config = config
        self.log_path = log_dir / f"{config.instance}.log"
        env = {**os.environ, **config.to_env(), "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "services.runtime.main"], env=env, cwd=REPO,
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    @property
    def address(self) -> str:
        return self.config.advertise

    def status(self, timeout_s: float = 0.5):
        return query_status(self.address, timeout_s)

    def wait_running(self, timeout_s: float = 30.0, upstream: bool = False):
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.config.instance} exited {self.proc.returncode}:\n{self.log()}")
            status = self.status()
            ok = status and status.state == ServiceState.RUNNING and (not upstream or status.upstream_connected)
            return status if ok else None
        return wait_until(ready, timeout_s, f"{self.config.instance} to be running")

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def tcp_config(kind: str, instance: str, **fields) -> ServiceConfig:
    port = free_port()
    return ServiceConfig(kind=kind, instance=instance, bind=f"tcp://127.0.0.1:{port}", **fields)


@pytest.fixture
def procs(tmp_path):
    """procs(config) -> a started ServiceProcess; every one is stopped after the test."""
    started: list[ServiceProcess] = []

    def start(config):
        proc = ServiceProcess(config, tmp_path)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()
