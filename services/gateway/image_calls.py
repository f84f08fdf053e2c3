"""The gateway's side of vision: resolving a request's images and naming the vision groups.

A request with images is prepared with one placeholder token per image. The gateway then fetches
each image (SSRF-safe, services/gateway/vision/), checks it decodes, plans its V4.1 grid, writes its
span into the prompt and hashes the prompt's blocks with the images' digests. The request carries
the images and the addresses of the live vision balancers (group leaders, registered here): the
prefill side picks one at random and the embeddings go straight to it, never through here.
A bad image is a 400 naming where it was; a model with vision but no live vision group is a 503.
"""
from __future__ import annotations

import asyncio

import msgspec

from messages.images import split_image_data
from services.gateway.adapter.errors import GatewayError, invalid_request
from services.gateway.identity import prompt_hashes, with_hashes
from services.gateway.vision import ImageInputError

BALANCER_KIND = "vision_balancer"


def vision_groups(service) -> list[str]:
    """Addresses of the live vision group leaders (sorted: the worker draws the random one)."""
    return sorted(p.address for p in service.members.alive(BALANCER_KIND) if p.accepts_work)


def no_vision() -> GatewayError:
    return GatewayError(503, "overloaded_error", "image inputs need a vision encoder pool and no vision "
                        "balancer is running; retry shortly", code="vision_unavailable")


def image_error(exc: ImageInputError, param: str) -> GatewayError:
    where = f" ({exc.path})" if exc.path else ""
    return invalid_request(f"{exc.message}{where}", param=exc.path or param, code=exc.code)


async def resolve_images(service, prepared):
    """`prepared` with its images fetched and their spans in the prompt, and its block hashes.
    Raises GatewayError (400 for a bad image, 503 without a vision group)."""
    if not vision_groups(service):
        raise no_vision()
    try:
        images = await service.images.resolve(prepared.image_sources)
    except ImageInputError as exc:
        raise image_error(exc, "messages") from None
    loop = asyncio.get_running_loop()
    prepared = await loop.run_in_executor(service.pool, service.adapter.with_images, prepared, images)
    return prepared, await prompt_hashes(service, prepared.prompt_ids, prepared.images)


def send_generate(service, request, wire_id: str, span) -> None:
    """GenerateRequest to the upstream; image bytes travel as buffer frames (messages/images.py).
    Overloaded (a WireError) while the model identity its block hashes need is unknown (identity.py)."""
    request = with_hashes(service, request)
    if not request.images:
        service.send(service.config.upstream, request, request_id=wire_id, span=span)
        return
    bare, frames = split_image_data(request.images)
    service.send(service.config.upstream, msgspec.structs.replace(request, images=bare), request_id=wire_id,
                 span=span, buffers=frames)
