"""Test-only: a service whose start fails half-way, after it acquired what a real one does (a socket
to a peer, a thread that never ends), so the tests can check that the process still exits at once."""
from __future__ import annotations

import threading

from services.runtime.service import Service


class TestHelperFailsAtStart(Service):
    kind = "test_helper_fails_at_start"
    __test__ = False   # not a pytest test class

    async def on_start(self) -> None:
        self.link("tcp://127.0.0.1:9")   # a socket that a bare context.term() would wait on
        threading.Thread(target=threading.Event().wait, name="never-ends").start()   # not a daemon
        raise RuntimeError("helper: the model directory is missing")

    async def on_stop(self) -> None:
        self.log.info("helper.on_stop")
