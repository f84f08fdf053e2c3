"""A streaming worker that dies fails its open requests at once, not after chunk_timeout_s.

The worker that streams a request names itself on its first chunk (GenerateChunk.worker). Every
`dead_after_s` the gateway asks each distinct streaming worker for its status, with that timeout;
no answer (TIMEOUT) or a dropped peer (PEER_DEAD) means dead, and each of its requests gets a 502
naming the worker. The decode worker watches its gateways the same way (workers/streaming.py).
"""
from __future__ import annotations

import asyncio

from messages.control import StatusQuery
from messages.errors import ErrorCode, WireError
from services.gateway.adapter.errors import API_ERROR, GatewayError
from services.gateway.open_requests import streaming_workers


async def watch_workers(svc) -> None:
    period = max(svc.config.dead_after_s, 0.05)
    while True:
        await asyncio.sleep(period)
        addresses = streaming_workers(svc.pending)
        if not addresses:
            continue
        try:
            alive = await asyncio.gather(*(_answers(svc, address, period) for address in addresses))
            for address, ok in zip(addresses, alive):
                if not ok:
                    worker_died(svc, address)
        except Exception:   # a bug here must not end the watch for good
            svc.log.exception("worker_watch.failed")


async def _answers(svc, address: str, timeout: float) -> bool:
    try:
        await svc.call(address, StatusQuery(), timeout=timeout)
        return True
    except WireError as exc:   # busy (OVERLOADED, DRAINING) is alive
        return exc.code not in (ErrorCode.TIMEOUT, ErrorCode.PEER_DEAD)


def worker_died(svc, address: str) -> None:
    """Fail every open request that `address` streams; forget the link to it."""
    held = [r for r in svc.pending.values() if r.worker == address]
    svc.log.warning("worker.dead", worker=address, requests=len(held))
    for request in held:   # each request's summary line says outcome=worker_died
        request.queue.put_nowait(GatewayError(
            502, API_ERROR, f"the worker streaming this request ({address}) died", code="worker_died"))
    if address != svc.config.upstream:   # the upstream link reconnects on its own
        svc.drop_link(address)
