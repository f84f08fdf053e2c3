"""A service that cannot start exits non-zero at once with a clear message (stderr and its log),
whatever held it: a taken address (its inbox or its /metrics), or an on_start that raised after
opening sockets and threads. Real processes; before the fix a taken port blocked forever."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from tests.helpers.test_helper_processes import REPO, free_port

pytestmark = pytest.mark.slow   # starts service processes

EXIT_WITHIN_S = 10.0   # generous for a loaded 2-core machine; a hang is what this catches


def serve(**env) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "services.runtime.main"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "EPD_INSTANCE": "svc-0", **env}, timeout=EXIT_WITHIN_S)
    return proc, time.monotonic() - started


def held_port() -> socket.socket:
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", free_port()))
    squatter.listen()
    return squatter


def test_a_taken_address_exits_non_zero_at_once_naming_it():
    with held_port() as squatter:
        address = f"tcp://127.0.0.1:{squatter.getsockname()[1]}"
        proc, took = serve(EPD_KIND="echo", EPD_BIND=address)
    assert proc.returncode == 1
    assert f"cannot bind {address}: address already in use" in proc.stderr
    assert '"event": "service.start_failed"' in proc.stdout and address in proc.stdout
    assert took < EXIT_WITHIN_S


def test_a_taken_metrics_port_exits_non_zero_naming_it():
    with held_port() as squatter:
        port = squatter.getsockname()[1]
        proc, _ = serve(EPD_KIND="echo", EPD_BIND=f"tcp://127.0.0.1:{free_port()}",
                        EPD_METRICS_BIND=f"127.0.0.1:{port}")
    assert proc.returncode == 1
    assert "svc-0 (echo) exits 1" in proc.stderr and "address already in use" in proc.stderr
    assert f"'127.0.0.1', {port}" in proc.stderr   # aiohttp names it so
    assert '"event": "service.task_failed"' in proc.stdout


def test_an_on_start_that_raises_exits_at_once_despite_its_socket_and_thread():
    proc, _ = serve(EPD_KIND="tests.runtime.test_helper_start_failure:TestHelperFailsAtStart",
                    EPD_BIND=f"tcp://127.0.0.1:{free_port()}")
    assert proc.returncode == 1
    assert "svc-0 (tests.runtime.test_helper_start_failure:TestHelperFailsAtStart) exits 1: " \
           "helper: the model directory is missing" in proc.stderr
    assert '"event": "helper.on_stop"' in proc.stdout   # what on_start acquired was released
