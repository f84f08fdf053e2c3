"""The SWA registry and a worker as real processes over TCP, killed with SIGKILL and restarted at the
same address by hand (as the supervisor does): a restarted registry is filled again by the worker
(its check-in is answered `known=False`), and a worker restarted at its address retires everything
its predecessor registered as soon as it checks in, not by the registry judging it silent.

Nothing here depends on how fast the host is: the waits are bounds for a loaded host, and the
registry would judge a silent worker only after hours."""
from __future__ import annotations

import dataclasses
import signal

import pytest

from messages.swa_registry import SwaLookup
from ops.control_client import call
from tests.helpers.test_helper_processes import ServiceProcess, procs, tcp_config, wait_until  # noqa: F401 - procs is a fixture

pytestmark = pytest.mark.slow   # starts service processes

HOLDER = "tests.swa_registry.test_helper_window_holder:TestHelperWindowHolder"
HELD = [i.to_bytes(32, "big") for i in range(1, 4)]
LOADED_S = 120.0    # how long a start or a rebuild may take on a loaded host before the test fails


def holders(registry: ServiceProcess) -> list[str] | None:
    reply = call(registry.address, SwaLookup(HELD), timeout_s=5.0)
    return list(reply.holders) if reply is not None else None


def kill(proc: ServiceProcess) -> None:
    proc.proc.send_signal(signal.SIGKILL)
    proc.proc.wait()


def test_a_killed_registry_is_rebuilt_and_a_restarted_worker_retires_its_predecessors_windows(procs):
    # the registry would judge a silent worker only after 5 hours: what happens here is the
    # incarnation at work, not the silence rule, however long a process takes to start
    registry_config = tcp_config("swa_registry", "swa", heartbeat_s=0.5, dead_after=36_000)
    registry = procs(registry_config)
    registry.wait_running(LOADED_S)
    worker_config = tcp_config(HOLDER, "worker", heartbeat_s=0.5,
                               settings={"swa_registry": registry.address, "held": [x.hex() for x in HELD]})
    worker = procs(worker_config)
    worker.wait_running(LOADED_S)
    wait_until(lambda: holders(registry) == [worker.address] * 3, LOADED_S, "the worker's windows registered")

    kill(registry)
    registry = procs(registry_config)          # same address, a new process: it knows nothing
    registry.wait_running(LOADED_S)
    wait_until(lambda: holders(registry) == [worker.address] * 3, LOADED_S, "the windows registered again")
    assert '"event": "swa_registry.registered_again"' in worker.log()
    assert '"registry_restarted": true' in worker.log()   # told by the restarted registry's answer

    kill(worker)                               # a new worker at the old address holds nothing
    worker = procs(dataclasses.replace(worker_config, settings={"swa_registry": registry.address}))
    worker.wait_running(LOADED_S)
    wait_until(lambda: holders(registry) == [""] * 3, LOADED_S, "the dead process's windows retired")
    assert '"seen": "replaced"' in registry.log()
    assert '"event": "swa_registry.holder_silent"' not in registry.log()
