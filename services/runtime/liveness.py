"""Watching peers that do not register with us (a worker's gateways, a gateway's streaming workers,
a prefill worker's decode worker during a hand-off): every `heartbeat_s` each one is asked for its
status, given `dead_after_s - heartbeat_s` to answer, so a death is known within about
`dead_after_s` (3 s by default), as a registered peer's would be. Dead: no answer (TIMEOUT),
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


def probe_timings(config) -> tuple[float, float]:
    """(period between probes, time a probe may take) for a service's heartbeat settings."""
    period = max(config.heartbeat_s, 0.05)
    return period, max(config.dead_after_s - period, period)


async def until_dead(service, address: str, incarnation: str = "") -> bool:
    """Return once `address` stops answering (or another process answers there): True if it was
    another process."""
    period, patience = probe_timings(service.config)
    while True:
        await asyncio.sleep(period)
        ok = await answers(service, address, patience, incarnation)
        if not ok:
            return ok is False


async def watch(service, peers: Callable[[], Iterable[tuple[str, str]]],
                on_dead: Callable[[str, str, bool], None]) -> None:
    """Forever: probe every (address, incarnation) `peers()` names; `on_dead(address, incarnation,
    answered)` for the dead ones (`answered`: the address is alive, with another process)."""
    period, patience = probe_timings(service.config)
    while True:
        await asyncio.sleep(period)
        watched = list(peers())
        if not watched:
            continue
        try:
            alive = await asyncio.gather(*(answers(service, address, patience, incarnation)
                                           for address, incarnation in watched))
            for (address, incarnation), ok in zip(watched, alive):
                if not ok:
                    on_dead(address, incarnation, ok is False)
        except Exception:   # a bug here must not end the watch for good
            service.log.exception("liveness_watch.failed")
