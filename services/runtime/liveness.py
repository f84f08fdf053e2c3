"""Watching peers that do not register with us (a worker's gateways, a gateway's streaming workers):
every `dead_after_s` each one is asked for its status with that timeout; no answer (TIMEOUT) or a
dropped peer (PEER_DEAD) means dead. Busy answers (OVERLOADED, DRAINING) mean alive."""
from __future__ import annotations

import asyncio
from typing import Callable, Iterable

from messages.control import StatusQuery
from messages.errors import ErrorCode, WireError


async def answers(service, address: str, timeout: float) -> bool:
    try:
        await service.call(address, StatusQuery(), timeout=timeout)
        return True
    except WireError as exc:
        return exc.code not in (ErrorCode.TIMEOUT, ErrorCode.PEER_DEAD)


async def watch(service, addresses: Callable[[], Iterable[str]], on_dead: Callable[[str], None]) -> None:
    """Forever: probe every address `addresses()` names; call `on_dead(address)` for the silent ones."""
    period = max(service.config.dead_after_s, 0.05)
    while True:
        await asyncio.sleep(period)
        watched = list(addresses())
        if not watched:
            continue
        try:
            alive = await asyncio.gather(*(answers(service, address, period) for address in watched))
            for address, ok in zip(watched, alive):
                if not ok:
                    on_dead(address)
        except Exception:   # a bug here must not end the watch for good
            service.log.exception("liveness_watch.failed")
