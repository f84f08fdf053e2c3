"""`/ready`: the gateway takes traffic only when every pool behind it has a live, registered worker.

`/health` stays liveness (the gateway runs and reaches its upstream). `/ready` asks, at each probe,
the services behind the gateway, all at once and each with a short timeout:
- its upstream. A unified worker must be RUNNING itself (pool "worker"). A router must have a live,
  RUNNING worker registered (the prefill router: pool "prefill"), and so must each service its status
  says it depends on (the prefill router's decode router: pool "decode");
- its aides, which register with the gateway: the kinds its `aides` setting names (the topology's) and
  any that registered. A grammar compiler must be live (pool "grammar"); a vision balancer must be live
  with a live vision worker behind it (pool "vision").
The answer names each pool, with why it is not ready.
"""
from __future__ import annotations

import asyncio

from messages.control import ServiceState, StatusQuery, StatusReply
from messages.errors import WireError

POOL_OF_KIND = {"prefill_router": "prefill", "decode_router": "decode", "unified_worker": "worker",
                "grammar_compiler": "grammar", "vision_balancer": "vision"}
AIDE_KINDS = ("grammar_compiler", "vision_balancer")
STATUS_TIMEOUT_S = 1.0
READY = "ready"


async def pools(svc) -> dict[str, str]:
    """Pool name -> READY, or why it is not ready."""
    if svc.state != ServiceState.RUNNING:
        return {"gateway": f"the gateway is {ServiceState(svc.state).name.lower()}"}
    found: dict[str, str] = {}
    upstream = svc.config.upstream
    reply = await _status(svc, upstream) if svc.upstream is not None and svc.upstream.connected else None
    if reply is None:
        found["upstream"] = f"the upstream {upstream} does not answer"
    elif reply.kind.endswith("_worker"):
        found[_pool(reply.kind)] = READY if reply.state == ServiceState.RUNNING else \
            f"{reply.instance} is {ServiceState(reply.state).name.lower()}"
    else:
        found[_pool(reply.kind)] = _workers(reply)
        behind = await asyncio.gather(*(_status(svc, address) for address in reply.depends_on))
        for address, status in zip(reply.depends_on, behind):
            if status is None:
                found[address] = f"{address} (needed by {reply.instance}) does not answer"
            else:
                found[_pool(status.kind)] = _workers(status)
    declared = set(svc.settings.aides) | {p.kind for p in svc.members.alive() if p.kind in AIDE_KINDS}
    for kind in sorted(declared):
        found[_pool(kind)] = await _aide(svc, kind)
    return found


def not_ready(found: dict[str, str]) -> dict[str, str]:
    return {pool: why for pool, why in found.items() if why != READY}


async def _aide(svc, kind: str) -> str:
    live = [p for p in svc.members.alive(kind) if p.accepts_work]
    if not live:
        return f"no live {kind} has registered with this gateway"
    if kind != "vision_balancer":
        return READY
    replies = await asyncio.gather(*(_status(svc, p.address) for p in live))
    answers = [_workers(r) for r in replies if r is not None]
    return READY if READY in answers else (answers[0] if answers else "no vision balancer answers")


def _workers(reply: StatusReply) -> str:
    live = [p for p in reply.peers if p.kind.endswith("_worker") and p.alive and p.state == ServiceState.RUNNING]
    return READY if live else f"no live worker has registered with {reply.instance}"


def _pool(kind: str) -> str:
    return POOL_OF_KIND.get(kind, kind)


async def _status(svc, address: str) -> StatusReply | None:
    try:
        reply = (await svc.call(address, StatusQuery(), timeout=STATUS_TIMEOUT_S)).message
    except WireError:
        return None
    return reply if isinstance(reply, StatusReply) else None
