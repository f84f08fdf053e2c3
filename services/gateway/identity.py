"""The model identity the gateway's block hashes carry: learned from the workers, never configured.

Workers announce their identity when they register (an engine's model_id covers the model
directory, the dtype and the weight format: `+released` is known to the worker alone). The
gateway's upstream names it in Registered and every HeartbeatAck: the prefill router its pool's, a
unified worker its own; services/runtime/upstream.py keeps the last one named.

A prompt shorter than one block has no hash, so it needs no identity. A longer one is hashed while
it is prepared; when no identity is known then, the gateway asks the upstream once (StatusQuery), so
a request sent just after the first worker registered does not wait for the next heartbeat. With
no identity known still (no worker registered), the request is refused with a retryable 503
`model_unknown` (Anthropic's 529 overloaded_error): never a hash chain no worker computes. A
request sent without hashes (a resumed attempt) gets them at send time, or an OVERLOADED error.
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence

import msgspec

from messages import WireError
from messages.control import StatusQuery
from messages.errors import Overloaded
from messages.generate import GenerateRequest
from messages.prefix import BLOCK_TOKENS, block_hashes
from services.gateway.adapter.errors import OVERLOADED, GatewayError

QUERY_TIMEOUT_S = 2.0
UNKNOWN = ("no worker has registered yet, so the model identity the prompt's block hashes carry is unknown; "
           "retry shortly")


def model_unknown(service, token_ids: Sequence[int]) -> GatewayError | None:
    """The 503 for a prompt of a block or more while no identity is known; None when it may go on."""
    if len(token_ids) < BLOCK_TOKENS or service.model_id:
        return None
    return GatewayError(503, OVERLOADED, UNKNOWN, code="model_unknown")


async def ask_upstream(service) -> str:
    """The identity the upstream names now (StatusQuery) when none is known yet; "" if it names none."""
    link = service.upstream
    if link is None:
        return ""
    if not link.model_id:
        try:
            reply = await service.call(service.config.upstream, StatusQuery(), timeout=QUERY_TIMEOUT_S)
            link.learn(reply.message.model_id)
        except WireError as exc:
            service.log.warning("model_identity.unavailable", upstream=service.config.upstream, error=exc.message)
    return link.model_id


async def prompt_hashes(service, token_ids: Sequence[int], images=()) -> list[bytes]:
    """The prompt's block hash chain under the workers' identity; [] while it is unknown (or too short)."""
    if len(token_ids) < BLOCK_TOKENS:
        return []
    model_id = service.model_id or await ask_upstream(service)
    return block_hashes(model_id, token_ids, images=images) if model_id else []


def prompt_hashes_from_thread(service, loop: asyncio.AbstractEventLoop | None, token_ids: Sequence[int]) -> list[bytes]:
    """prompt_hashes for a pool thread (the gateway's prepare): the upstream is asked on `loop`."""
    if len(token_ids) < BLOCK_TOKENS:
        return []
    model_id = service.model_id
    if not model_id and loop is not None and loop.is_running() and not _on_loop(loop):
        model_id = asyncio.run_coroutine_threadsafe(ask_upstream(service), loop).result(QUERY_TIMEOUT_S + 1)
    return block_hashes(model_id, token_ids) if model_id else []


def with_hashes(service, request: GenerateRequest) -> GenerateRequest:
    """`request` as it may be sent: hashed if it was not yet; Overloaded while no identity is known."""
    if request.block_hashes or len(request.prompt_ids) < BLOCK_TOKENS:
        return request
    if not service.model_id:
        raise Overloaded(UNKNOWN)
    hashes = block_hashes(service.model_id, request.prompt_ids, images=request.images)
    return msgspec.structs.replace(request, block_hashes=hashes)


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
