"""The prefill side of the vision pool: a prefill or unified worker gets a request's image rows.

`await client.encode(request_id, images, groups)` picks one of the live group leaders (vision
balancers, GenerateRequest.vision_groups) at random, calls it with VisionEncode
(reply_to: this worker) and collects one VisionEncoded per image, sent here straight by the vision
workers: a list of [grid.tokens, hidden] tensors in image order, views of the received frames.
An attempt that is refused, reports a worker-side outage, or runs past `timeout_s` is cancelled
and tried again on the next group (the same one when there is only one), for the images still
missing, until 2 x `timeout_s` have passed; when every group refused at once (its workers are
restarting) the next round waits a backoff first. A bad image (or any other failure) raises VisionError with the pool's ErrorCode at once.
`cancel(request_id)` (the request was aborted) tells the leaders and ends the wait.

The worker merges `client.handlers()` into its own, and should list VisionEncoded and VisionFailed
in its `continuation_types` (answers to work it holds) and `streamed_types` (one log line per
request, not per image).
"""
from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import torch

from messages.control import ServiceState
from messages.errors import ErrorCode, RequestTimeout, WireError
from messages.images import ImageInput
from messages.vision import VisionCancel, VisionEncode, VisionEncoded, VisionFailed, image_frames
from services.runtime.context import Context
from services.runtime.tracing import SpanContext
from services.workers.tensors import torch_frame

# failures of one group that another group may not share: worth the one retry
RETRYABLE = frozenset({ErrorCode.OVERLOADED, ErrorCode.DRAINING, ErrorCode.PEER_DEAD, ErrorCode.TIMEOUT})
RETRY_BACKOFF_S, MAX_BACKOFF_S = 0.25, 2.0   # after every group refused at once (a worker restarting)


class VisionError(WireError):
    """The vision pool could not encode a request's images; `code` is its ErrorCode (INVALID_REQUEST:
    a bad image; OVERLOADED / PEER_DEAD / TIMEOUT: no group could encode it)."""

    def __init__(self, code: int, message: str, *, request_id: str = "", index: int = -1):
        super().__init__(message, request_id=request_id)
        try:
            self.code = ErrorCode(code)
        except ValueError:
            self.code = ErrorCode.INTERNAL
        self.index = index   # the image that failed (-1: not one image's fault)


@dataclass(slots=True)
class _Pending:
    images: list[ImageInput]
    rows: list = field(default_factory=list)
    missing: set[int] = field(default_factory=set)
    leaders: list[str] = field(default_factory=list)   # every leader asked, for cancels
    attempt: int = 0                                    # failures of an earlier attempt are ignored
    error: VisionError | None = None
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    def settle(self, error: VisionError | None = None) -> None:
        if error is not None and self.error is None:
            self.error = error
        self.finished.set()


class VisionClient:
    def __init__(self, service, timeout_s: float = 30.0, accept_timeout_s: float = 5.0,
                 rng: random.Random | None = None):
        if timeout_s <= 0 or accept_timeout_s <= 0:
            raise ValueError("timeout_s and accept_timeout_s must be > 0")
        self.service = service
        self.timeout_s = timeout_s                 # one attempt: from the leader's acceptance to the last image
        self.accept_timeout_s = accept_timeout_s   # the leader's VisionAccepted
        self.rng = rng or random.Random()
        self._pending: dict[str, _Pending] = {}

    def handlers(self) -> dict:
        return {VisionEncoded: self.on_encoded, VisionFailed: self.on_failed}

    def in_flight(self) -> int:
        return len(self._pending)

    async def encode(self, request_id: str, images: list[ImageInput], groups: list[str],
                     span: SpanContext | None = None) -> list[torch.Tensor]:
        if not images:
            return []
        if not request_id or request_id in self._pending:
            raise VisionError(ErrorCode.INVALID_REQUEST, f"request id {request_id!r} is empty or already encoding",
                              request_id=request_id)
        if not groups:
            raise VisionError(ErrorCode.OVERLOADED, "no vision group is running: the request has images",
                              request_id=request_id)
        pending = _Pending(images, [None] * len(images), set(range(len(images))))
        self._pending[request_id] = pending
        try:
            return await self._attempts(request_id, pending, self._leaders(groups), span)
        except asyncio.CancelledError:
            self._cancel_at(request_id, pending.leaders)
            raise
        finally:
            self._pending.pop(request_id, None)

    def cancel(self, request_id: str) -> None:
        """The request was aborted: the leaders drop its images, `encode` raises VisionError(ABORTED)."""
        pending = self._pending.get(request_id)
        if pending is None:
            return
        self._cancel_at(request_id, pending.leaders)
        pending.settle(VisionError(ErrorCode.ABORTED, "the request was cancelled", request_id=request_id))

    # ---- attempts ----------------------------------------------------------------------
    def _leaders(self, groups: list[str]) -> list[str]:
        """The groups in the order they are tried: a random one first (DeepSeek's rule), then the others in
        random order; attempts cycle through them."""
        order = list(groups)
        self.rng.shuffle(order)
        return order

    async def _attempts(self, request_id: str, pending: _Pending, leaders: list[str],
                        span: SpanContext | None) -> list[torch.Tensor]:
        """Attempts until one encodes every image, a failure no other attempt can mend, or the deadline
        (2 x timeout_s). A group that refuses at once (no worker running: one restarting after a crash)
        is asked again after a backoff, so a restart costs the request time, not an error."""
        loop = asyncio.get_running_loop()
        deadline, backoff = loop.time() + 2 * self.timeout_s, RETRY_BACKOFF_S
        attempt = 0
        while True:
            leader = leaders[attempt % len(leaders)]
            pending.attempt = attempt
            started = loop.time()
            try:
                await self._submit(leader, request_id, pending, span)
                async with asyncio.timeout(max(0.0, min(self.timeout_s, deadline - loop.time()))):
                    await pending.finished.wait()
            except TimeoutError:
                error = VisionError(ErrorCode.TIMEOUT, f"{len(pending.missing)} image(s) not encoded within "
                                                       f"{self.timeout_s} s by {leader}", request_id=request_id)
            except WireError as exc:   # the leader refused or did not answer the call
                error = VisionError(exc.code, f"{leader}: {exc.message}", request_id=request_id)
            else:
                if pending.error is None:
                    return pending.rows
                error = pending.error
            quick = loop.time() - started < backoff
            if error.code not in RETRYABLE or loop.time() + (backoff if quick else 0) >= deadline:
                break
            self._cancel_at(request_id, [leader])
            self.service.log.warning("vision.retry", request_id=request_id, leader=leader, code=error.code.name,
                                     error=error.message[:200], missing=len(pending.missing), attempt=attempt)
            pending.error = None
            pending.finished.clear()
            attempt += 1
            if quick and attempt % len(leaders) == 0:   # every group refused at once: give them time
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
        self._cancel_at(request_id, pending.leaders)
        raise error

    async def _submit(self, leader: str, request_id: str, pending: _Pending, span: SpanContext | None) -> None:
        """Call the leader with the images still missing; returns once it accepted them."""
        where = sorted(pending.missing)
        bare, frames = image_frames([pending.images[i] for i in where])
        pending.leaders.append(leader)
        await self.service.call(leader, VisionEncode(bare, self.service.config.advertise, where,
                                                     attempt=pending.attempt),
                                request_id=request_id, span=span, buffers=frames, timeout=self.accept_timeout_s)

    def _cancel_at(self, request_id: str, leaders: list[str]) -> None:
        if self.service.state == ServiceState.STOPPED:   # sockets closed: nothing can be told any more
            return
        for leader in dict.fromkeys(leaders):
            try:
                self.service.send(leader, VisionCancel(), request_id=request_id)
            except WireError:   # the leader is gone: nothing of ours is queued there any more
                pass

    # ---- answers from the vision workers -----------------------------------------------
    async def on_encoded(self, msg: VisionEncoded, ctx: Context) -> None:
        pending = self._pending.get(ctx.request_id)
        if pending is None or msg.index not in pending.missing:
            return   # a late or repeated answer (a retried attempt, a re-dispatched job): already have it
        image = pending.images[msg.index]
        try:
            rows = torch_frame(ctx.envelope, 0)
        except WireError as exc:
            pending.settle(VisionError(ErrorCode.INTERNAL, f"image {msg.index}'s rows: {exc.message}",
                                       request_id=ctx.request_id, index=msg.index))
            return
        if bytes(msg.digest) != bytes(image.digest) or rows.ndim != 2 or rows.shape[0] != image.grid.tokens:
            pending.settle(VisionError(ErrorCode.INTERNAL, f"image {msg.index}: rows {list(rows.shape)} for another "
                                                           f"image or span (expected {image.grid.tokens} rows)",
                                       request_id=ctx.request_id, index=msg.index))
            return
        pending.rows[msg.index] = rows
        pending.missing.discard(msg.index)
        if not pending.missing:
            pending.settle()

    async def on_failed(self, msg: VisionFailed, ctx: Context) -> None:
        pending = self._pending.get(ctx.request_id)
        if pending is None or msg.index not in pending.missing or msg.attempt != pending.attempt:
            return   # unknown, already encoded, or an attempt given up on
        pending.settle(VisionError(msg.code, f"image {msg.index}: {msg.message}", request_id=ctx.request_id,
                                   index=msg.index))
