"""A streaming worker that dies is noticed at once, not after chunk_timeout_s.

The worker that streams a request names itself on its first chunk (GenerateChunk.worker); the
gateway watches each distinct streaming worker (services/runtime/liveness.py). A dead one's
requests each get a `worker_died` error, which the request's handler turns into a resume on
another worker (resume.py), or a 502 naming the worker once its resumes are used up. The
streaming workers watch their gateways the same way.
"""
from __future__ import annotations

from services.gateway.adapter.errors import API_ERROR, GatewayError
from services.gateway.open_requests import streaming_workers
from services.runtime import liveness


async def watch_workers(svc) -> None:
    await liveness.watch(svc, lambda: streaming_workers(svc.pending), lambda *dead: worker_died(svc, *dead))


def worker_died(svc, address: str, incarnation: str = "", answered: bool = False) -> None:
    """Fail every open request that process streams; forget the link to an address nobody answers."""
    held = [r for r in svc.pending.values() if r.worker == address and r.worker_incarnation == incarnation]
    svc.log.warning("worker.dead", worker=address, incarnation=incarnation or None, restarted=answered,
                    requests=len(held))
    for request in held:   # each request's summary line says outcome=worker_died
        request.put(GatewayError(
            502, API_ERROR, f"the worker streaming this request ({address}) died", code="worker_died"))
    if not answered and address != svc.config.upstream:   # the upstream link reconnects on its own
        svc.drop_link(address)
