"""VisionBalancerService: a group's leader in the vision pool (README.md).

The group's vision workers register with it. VisionEncode (a call from a prefill or unified worker)
is answered VisionAccepted once every image is on a worker: each image goes to the worker with the
fewest queued patches by the leader's own count (policy.py, core.py), the images one worker gets
forwarded as one job. Workers report VisionDone when a job ends. A worker that dies or refuses a
job (draining, full) has its unfinished jobs placed on the others; with none left the images are
answered VisionFailed, so no request waits for rows that will never come. VisionCancel is passed
to the workers holding the request. The leader registers with its upstream (the gateway), every
replica of it, and each gateway lists the live leaders in every request with images.

Settings (ServiceConfig.settings): policy ("patches" | "round_robin" | "random"), seed, max_jobs.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from messages import ErrorReply
from messages.control import Load, Register, Registered
from messages.errors import ErrorCode, InvalidRequest, Overloaded, WireError
from messages.envelope import random_hex
from messages.vision import (VisionAccepted, VisionCancel, VisionDone, VisionEncode, VisionFailed, images_from,
                             positions)
from services.runtime.config import ServiceConfig
from services.runtime.context import Context
from services.runtime.membership import Peer
from services.runtime.service import Handler, Service
from services.runtime.settings import parse_settings
from services.runtime.tracing import SpanContext
from services.vision_balancer.core import BalancerCore, Job, Placement
from services.vision_balancer.metrics import BalancerCounts, declare_metrics
from services.vision_balancer.policy import POLICIES

WORKER_KIND = "vision_worker"
# a worker's refusals that another worker may not share: the job is placed elsewhere
PASSING_CODES = (ErrorCode.DRAINING, ErrorCode.OVERLOADED, ErrorCode.PEER_DEAD)


@dataclass(slots=True, frozen=True)
class VisionBalancerSettings:
    policy: str = "patches"     # DeepSeek's rule; round_robin and random are baselines for `epd bench vision`
    seed: int = -1              # the random policy's seed (-1: unseeded)
    max_jobs: int = 65536       # jobs held at once; beyond it VisionEncode is OVERLOADED

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.max_jobs < 1:
            raise ValueError("max_jobs must be >= 1")


@dataclass(slots=True)
class Route:
    """Where a request's answers go, and its trace span."""
    reply_to: str
    span: SpanContext
    attempt: int = 0


class VisionBalancerService(Service):
    kind = "vision_balancer"
    continuation_types = (VisionDone, VisionCancel, ErrorReply)   # work already placed still settles while draining

    def __init__(self, config: ServiceConfig):
        self.settings = parse_settings(VisionBalancerSettings, config.settings, self.kind)
        super().__init__(config)
        s = self.settings
        self.core = BalancerCore(s.policy, random.Random(s.seed if s.seed >= 0 else None), prefix=f"{random_hex(32)}-")
        self.counts = BalancerCounts()
        self._pids: dict[str, int] = {}   # worker instance -> the pid it registered with
        declare_metrics(self.metrics, self)

    def handlers(self) -> dict[type, Handler]:
        return {VisionEncode: self.on_encode, VisionDone: self.on_done, VisionCancel: self.on_cancel,
                ErrorReply: self.on_worker_error}

    def in_flight(self) -> int:
        return self._active + len(self.core.jobs)

    def load(self) -> Load:
        return Load(queue_depth=len(self._backlog), in_flight=self.in_flight(),
                    queued_tokens=sum(q.patches for q in self.core.queues.values()))

    def workers(self) -> list[str]:
        return [p.instance for p in self.members.alive(WORKER_KIND) if p.accepts_work]

    # ---- handlers ----------------------------------------------------------------------
    async def on_encode(self, msg: VisionEncode, ctx: Context) -> VisionAccepted:
        images = images_from(ctx.envelope)   # frames checked against the images
        where = positions(msg)
        if not ctx.request_id or not msg.reply_to or not images:
            raise InvalidRequest("VisionEncode needs a request id, a reply_to and at least one image",
                                 request_id=ctx.request_id)
        if len(set(where)) != len(where) or min(where) < 0:
            raise InvalidRequest(f"image indexes must be distinct and >= 0, got {where}", request_id=ctx.request_id)
        if len(self.core.jobs) >= self.settings.max_jobs:
            raise Overloaded(f"{self.config.instance} holds {len(self.core.jobs)} jobs (max_jobs)",
                             request_id=ctx.request_id)
        if not self.workers():
            raise Overloaded(f"no vision worker of {self.config.instance}'s group is running",
                             request_id=ctx.request_id)
        placements = [Placement(position, image.grid.patches, (msg.images[i], ctx.envelope.frame(i)))
                      for i, (position, image) in enumerate(zip(where, images))]
        route = Route(msg.reply_to, ctx.span, msg.attempt)
        jobs = self._place(ctx.request_id, placements, route, set(), ErrorCode.OVERLOADED)
        self.counts.requests += 1
        return VisionAccepted(sorted({job.worker for job in jobs}))

    async def on_done(self, msg: VisionDone, ctx: Context) -> None:
        job = self.core.done(msg.job, ctx.sender)
        if job is None:
            self.log.info("vision.late_done", job=msg.job, worker=ctx.sender)
            return
        self.counts.jobs_done += 1

    async def on_cancel(self, msg: VisionCancel, ctx: Context) -> None:
        for job in self.core.cancel(ctx.request_id):
            self.counts.cancelled += 1
            self._to_worker(job.worker, VisionCancel(job.id), job.request_id)

    async def on_worker_error(self, msg: ErrorReply, ctx: Context) -> None:
        """A worker refused a job we forwarded (our forward's msg id is the job id)."""
        job = self.core.refused(ctx.envelope.header.in_reply_to, ctx.sender)
        if job is None:
            self.log.info("vision.error_reply", code=msg.code, error=msg.message[:200], sender=ctx.sender)
            return
        self.log.warning("vision.job_refused", job=job.id, worker=job.worker, code=msg.code, error=msg.message[:200])
        if msg.code in PASSING_CODES and not job.cancelled:
            self._replace([job], exclude={job.worker}, code=msg.code)
        elif not job.cancelled:
            self._fail(job.request_id, job.context, job.positions, msg.code, f"a vision worker refused the image: "
                                                                           f"{msg.message}")

    # ---- workers coming and going ------------------------------------------------------
    def on_peer_dead(self, peer: Peer) -> None:
        if peer.kind != WORKER_KIND:
            return
        orphans = self.core.orphaned(peer.instance)
        self.log.warning("vision.worker_dead", worker=peer.instance, jobs=len(orphans))
        self._replace(orphans, exclude={peer.instance}, code=ErrorCode.PEER_DEAD)

    async def _on_register(self, msg: Register, ctx: Context) -> Registered:
        """A worker that restarted faster than it could be declared dead lost its queue: place its jobs again."""
        previous = self._pids.get(msg.instance)
        self._pids[msg.instance] = msg.pid
        registered = await super()._on_register(msg, ctx)
        if msg.kind == WORKER_KIND and previous is not None and previous != msg.pid:
            orphans = self.core.orphaned(msg.instance)
            if orphans:
                self.log.warning("vision.worker_restarted", worker=msg.instance, jobs=len(orphans))
                self._replace(orphans, exclude={msg.instance}, code=ErrorCode.PEER_DEAD)
        return registered

    # ---- placing -----------------------------------------------------------------------
    def _place(self, request_id: str, placements: list[Placement], route: Route, exclude: set[str],
               code: int) -> list[Job]:
        """Put the images on workers not in `exclude`, passing over one that cannot be reached; those
        no worker can take are answered VisionFailed (`code`)."""
        placed: list[Job] = []
        while placements:
            workers = [w for w in self.workers() if w not in exclude]
            if not workers:
                self._fail(request_id, route, [p.position for p in placements], code,
                           "no vision worker of the group can take the image")
                break
            unplaced: list[Placement] = []
            for job in self.core.dispatch(request_id, workers, placements, route):
                if self._forward(job):
                    placed.append(job)
                else:
                    self.core.refused(job.id, job.worker)
                    exclude.add(job.worker)
                    unplaced += _placements(job)
            placements = unplaced
        return placed

    def _replace(self, jobs: list[Job], exclude: set[str], code: int) -> None:
        for job in jobs:
            if job.cancelled:
                continue
            self.counts.redispatched += 1
            self._place(job.request_id, _placements(job), job.context, set(exclude), code)

    def _forward(self, job: Job) -> bool:
        peer = self.members.get(job.worker)
        images = [image for image, _ in job.payload]
        frames = [frame for _, frame in job.payload]
        try:
            route = job.context
            self.send(peer.address, VisionEncode(images, route.reply_to, job.positions, job.id, route.attempt),
                      request_id=job.request_id, span=route.span, buffers=frames, msg_id=job.id)
        except WireError as exc:
            self.log.warning("vision.forward_failed", job=job.id, worker=job.worker, code=exc.code.name)
            return False
        self.counts.images += len(images)
        self.counts.patches += job.patches
        return True

    def _to_worker(self, instance: str, message, request_id: str) -> None:
        peer = self.members.get(instance)
        if peer is None or not peer.alive:
            return
        try:
            self.send(peer.address, message, request_id=request_id)
        except WireError as exc:
            self.log.warning("vision.send_failed", worker=instance, code=exc.code.name)

    def _fail(self, request_id: str, route: Route, where: list[int], code: int, why: str) -> None:
        self.counts.failed += len(where)
        self.log.warning("vision.images_failed", request_id=request_id, images=len(where), code=ErrorCode(code).name)
        for position in where:
            try:
                self.send(route.reply_to, VisionFailed(position, int(code), why, route.attempt),
                          request_id=request_id, span=route.span)
            except WireError as exc:   # the prefill worker is gone too: nobody is left to tell
                self.log.warning("vision.failure_undeliverable", request_id=request_id, code=exc.code.name)
                return


def _placements(job: Job) -> list[Placement]:
    return [Placement(position, image.grid.patches, (image, frame))
            for position, (image, frame) in zip(job.positions, job.payload)]
