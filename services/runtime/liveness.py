"""Watching peers that do not register with us (a worker's gateways, a gateway's streaming workers):
every `dead_after_s` each one is asked for its status with that timeout. Dead: no answer (TIMEOUT),
a dropped peer (PEER_DEAD), or an answer from another process than the one watched (its
incarnation differs: the peer was restarted at the same address and lost what it held). Busy
answers (OVERLOADED, DRAINING) mean alive. A peer is (address, incarnation); "" = any process."""
from __future__ import annotations

import asyncio
from typing import Callable, Iterable

from messages.control import StatusQuery
from messages.errors import ErrorCode, WireError


async def answers(service, address: str, timeout: float, incarnation: str = "") -> bool | None:
    """True: the watched process answered; False: another process answered there; None: nobody."""
    try:
        reply = (await service.call(address, StatusQuery(), timeout=timeout)).message
    except WireError as exc:
        return True if exc.code not in (ErrorCode.TIMEOUT, ErrorCode.PEER_DEAD) else None
    return not incarnation or reply.incarnation == incarnation


async def watch(service, peers: Callable[[], Iterable[tuple[str, str]]],
                on_dead: Callable[[str, str, bool], None]) -> None:
    """Forever: probe every (address, incarnation) `peers()` names; `on_dead(address, incarnation,
    answered)` for the dead ones (`answered`: the address is alive, with another process)."""
    period = max(service.config.dead_after_s, 0.05)
    while True:
        await asyncio.sleep(period)
        watched = list(peers())
        if not watched:
            continue
        try:
            alive = await asyncio.gather(*(answers(service, address, period, incarnation)
                                           for address, incarnation in watched))
            for (address, incarnation), ok in zip(watched, alive):
                if not ok:
                    on_dead(address, incarnation, ok is False)
        except Exception:   # a bug here must not end the watch for good
            service.log.exception("liveness_watch.failed")
