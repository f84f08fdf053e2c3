"""Test-only: services started in this test's event loop over real ZeroMQ (ipc sockets under a tmp
dir), waited for without sleeping, and stopped at the end with each checked to exit cleanly."""
from __future__ import annotations

import asyncio

from messages.control import ServiceState
from services.runtime.config import ServiceConfig
from services.runtime.service import Service
from tests.helpers.test_helper_async import eventually

# A dead peer is noticed after 1.5 s. At 0.1 s x 5, an in-process engine step holding the GIL on a loaded
# machine stalled the loop past 0.5 s: a decode worker took the gateway for dead and dropped its request.
FAST = {"heartbeat_s": 0.1, "dead_after": 15}


class InProcessServices:
    def __init__(self, tmp_path, timing: dict | None = None):
        self.tmp_path = tmp_path
        self.timing = FAST if timing is None else timing
        self.tasks: list[tuple[Service, asyncio.Task]] = []

    async def start(self, cls, name: str, settings=None, upstream: str = "",
                    upstream_replicas: tuple[str, ...] = ()) -> Service:
        config = ServiceConfig(kind=cls.kind, instance=name, bind=f"ipc://{self.tmp_path}/{name}.sock",
                               upstream=upstream, upstream_replicas=upstream_replicas, settings=settings or {},
                               **self.timing)
        svc = cls(config)
        task = asyncio.create_task(svc.run(install_signals=False))
        self.tasks.append((svc, task))
        await eventually(lambda: svc.state != ServiceState.STARTING or task.done(), timeout=120, what=f"{name} started")
        assert not task.done(), f"{name} failed to start"
        return svc

    async def close(self) -> None:
        for svc, _ in reversed(self.tasks):
            svc.stop()
        codes = await asyncio.gather(*(task for _, task in self.tasks))
        assert all(code == 0 for code in codes)
