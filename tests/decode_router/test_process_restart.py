"""The decode router as a real process, killed with SIGKILL and restarted at its address (as the
supervisor does), with decode workers as processes at the default heartbeat (1 s, dead after 3):
its load table is complete again within a few seconds of the restart."""
from __future__ import annotations

import signal
import time

import pytest

from messages.routing import DecodeTable, DecodeTableQuery
from ops.control_client import call
from tests.helpers.test_helper_processes import ServiceProcess, procs, tcp_config, wait_until  # noqa: F401 - procs is a fixture

pytestmark = pytest.mark.slow   # starts service processes

DECODE_WORKER = "tests.decode_router.test_service:TestHelperDecodeWorker"   # kind "decode_worker"


def listed(router: ServiceProcess) -> list[str]:
    reply = call(router.address, DecodeTableQuery(), timeout_s=0.5)
    return sorted(w.instance for w in reply.workers) if isinstance(reply, DecodeTable) else []


def test_a_killed_decode_router_has_its_whole_table_back_within_seconds(procs):
    router_config = tcp_config("decode_router", "decode_router")
    router = procs(router_config)
    router.wait_running()
    names = ["decode-0", "decode-1"]
    for name in names:
        procs(tcp_config(DECODE_WORKER, name, upstream=router.address)).wait_running(upstream=True)
    wait_until(lambda: listed(router) == names, 10, "both decode workers in the table")

    router.proc.send_signal(signal.SIGKILL)
    router.proc.wait()
    router = procs(router_config)          # same address, a new process: an empty table
    router.wait_running()
    back = time.monotonic()
    wait_until(lambda: listed(router) == names, 10, "the table rebuilt")
    # the next heartbeat (<= 1 s) is answered known=False; 0.25 s back-off; the registration
    assert time.monotonic() - back < 3.0
