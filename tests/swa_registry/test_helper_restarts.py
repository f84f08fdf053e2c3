"""Test-only: in-process services (tests/helpers/test_helper_services.py) of which one can be
restarted: stopped, then started again under the same name and address as a new incarnation, the
way the supervisor restarts a crashed process."""
from __future__ import annotations

from services.runtime.service import Service
from tests.helpers.test_helper_services import InProcessServices


class RestartableServices(InProcessServices):
    def __init__(self, tmp_path, timing: dict | None = None):
        super().__init__(tmp_path, timing)
        self._started: dict[str, tuple[type, dict, str]] = {}

    async def start(self, cls, name: str, settings=None, upstream: str = "") -> Service:
        self._started[name] = (cls, settings or {}, upstream)
        return await super().start(cls, name, settings, upstream)

    async def stop(self, svc: Service) -> None:
        """Stop one service now (its in-flight work is abandoned, as by a kill)."""
        [task] = [t for s, t in self.tasks if s is svc]
        svc.stop()
        assert await task == 0
        self.tasks = [(s, t) for s, t in self.tasks if s is not svc]

    async def start_again(self, name: str) -> Service:
        cls, settings, upstream = self._started[name]
        return await self.start(cls, name, settings, upstream)

    async def restart(self, svc: Service) -> Service:
        await self.stop(svc)
        fresh = await self.start_again(svc.config.instance)
        assert fresh.config.advertise == svc.config.advertise and fresh.incarnation != svc.incarnation
        return fresh
