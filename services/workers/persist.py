"""BlockPersister: a worker's completed 128-token blocks go to the KV writer (KvWritePages) and the
window states it saved at their ends are advertised to the SWA registry (SwaRegister). Both are
one-way notifications (the services answer only on error), batched, never blocking a step: a
request is queued for a look and one background loop collects its new blocks on the engine thread.

Every registration names this process (its incarnation), so a worker restarted at the same address
is never taken for its predecessor. Every heartbeat interval the worker checks in with the registry
(an acknowledged SwaRegister without hashes): an answer `known=False` (the registry restarted, or
forgot this worker while it was silent) makes it register every window state it still holds again,
and so does any registration it could not deliver. A check-in waits dead_after_s for its answer, not
one interval: on a slow network or a loaded host a round trip may take longer than an interval, and
an answer given up on is refused when it comes, so the worker would never learn it must register
again. A check-in unanswered for that long gets a fresh link (ZeroMQ's reconnect back-off would
otherwise delay noticing the registry's return by seconds) and is tried again on the upstream link's
back-off (services/runtime/upstream.py) until one is answered.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from messages.errors import WireError
from messages.kv_store import KvWritePages
from messages.swa_registry import SwaRegister
from services.runtime.tracing import SpanContext
from services.runtime.upstream import BACKOFF_START_S, next_backoff
from services.workers.tensors import to_frame

WRITE_BATCH_BLOCKS = 256   # pages per KvWritePages / hashes per SwaRegister (both services cap a message)


@dataclass(slots=True)
class PersistJob:
    """One request's persistence: what is sent, whether it finished (forget it once persisted)."""

    traffic_class: int
    span: SpanContext | None
    blocks_sent: int = 0
    queued: bool = False
    finished: bool = False


def held_states(engine) -> list[bytes]:
    """On the engine thread: the hash of every boundary state this engine holds (served on SwaFetch)."""
    return list(engine.kv.boundaries.states)


def collect_blocks(engine, request_id: str, first_block: int):
    """On the engine thread: full blocks from `first_block` on, and the hashes of those with a saved
    boundary state here (window + tails at the block's end)."""
    try:
        blocks = engine.completed_blocks(request_id, first_block)
    except ValueError:
        return [], []
    boundaries = engine.kv.boundaries
    return blocks, [h for h, _ in blocks if h in boundaries]


class BlockPersister:
    def __init__(self, worker):
        self.worker = worker          # the EngineWorker: settings, engine(), send(), log
        self.jobs: dict[str, PersistJob] = {}
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self.blocks_persisted = 0
        self.states_registered = 0
        self.registry_incarnation = ""    # the SWA registry process that answered the last check-in
        self.reregistrations = 0          # times every held state was registered again
        self._reregister_due = False      # a registration was lost: register all at the next answer

    def wanted(self) -> bool:
        s = self.worker.settings
        return bool(s.kv_writer or s.swa_registry)

    def request(self, request_id: str, span: SpanContext | None, traffic_class: int, finished: bool = False) -> None:
        """Queue a look for the request's new full blocks; never blocks the caller or a step."""
        if not self.wanted():
            return
        job = self.jobs.setdefault(request_id, PersistJob(traffic_class, span))
        job.finished |= finished
        if not job.queued:
            job.queued = True
            self._queue.put_nowait(request_id)

    async def run(self) -> None:
        checks = asyncio.get_running_loop().create_task(self._check_in_loop()) \
            if self.worker.settings.swa_registry else None
        try:
            await self._persist_loop()
        finally:
            if checks is not None:
                checks.cancel()
                await asyncio.gather(checks, return_exceptions=True)

    async def _persist_loop(self) -> None:
        while True:
            request_id = await self._queue.get()
            job = self.jobs[request_id]
            job.queued = False
            try:
                await self._persist(request_id, job)
            except asyncio.CancelledError:
                raise
            except Exception:   # a bug here must not stop persistence for good
                self.worker.log.exception("persist.failed", request_id=request_id)
            if job.finished and not job.queued:
                del self.jobs[request_id]

    async def _persist(self, request_id: str, job: PersistJob) -> None:
        worker = self.worker
        blocks, states = await worker.engine(collect_blocks, request_id, job.blocks_sent)
        if not blocks:
            return
        job.blocks_sent += len(blocks)
        for start in range(0, len(blocks) if worker.settings.kv_writer else 0, WRITE_BATCH_BLOCKS):
            batch = blocks[start : start + WRITE_BATCH_BLOCKS]
            message = KvWritePages([h for h, _ in batch], list(range(len(batch))), worker.layout, job.traffic_class)
            try:
                worker.send(worker.settings.kv_writer, message, request_id=request_id, span=job.span,
                            buffers=[to_frame(page) for _, (page,) in batch])
                self.blocks_persisted += len(batch)
            except WireError as exc:
                worker.log.warning("kv_write.undeliverable", request_id=request_id, code=exc.code.name)
                break
        self.advertise(states, request_id, job.span)

    def advertise(self, hashes: list[bytes], request_id: str = "", span: SpanContext | None = None) -> None:
        """Register window states this worker holds (holder = its advertised address, this process)."""
        worker = self.worker
        if not hashes or not worker.settings.swa_registry:
            return
        hashes = list(hashes)
        for start in range(0, len(hashes), WRITE_BATCH_BLOCKS):
            batch = hashes[start : start + WRITE_BATCH_BLOCKS]
            try:
                worker.send(worker.settings.swa_registry, self._registration(batch), request_id=request_id,
                            span=span)
                self.states_registered += len(batch)
            except WireError as exc:
                worker.log.warning("swa_register.undeliverable", request_id=request_id or None, code=exc.code.name)
                self._reregister_due = True
                return

    def _registration(self, hashes: list[bytes], ack: bool = False) -> SwaRegister:
        worker = self.worker
        return SwaRegister(hashes, worker.config.advertise, worker.settings.swa_ttl_s, ack, worker.incarnation)

    # ---- the registry's restarts -----------------------------------------------------------------
    async def _check_in_loop(self) -> None:
        worker, cfg = self.worker, self.worker.config
        loop = asyncio.get_running_loop()
        backoff, unanswered = BACKOFF_START_S, 0
        while True:
            started = loop.time()
            try:
                reply = await worker.call(worker.settings.swa_registry, self._registration([], ack=True),
                                          timeout=cfg.dead_after_s)
                backoff, unanswered = BACKOFF_START_S, 0
                await self._checked_in(reply.message)
                pause = cfg.heartbeat_s - (loop.time() - started)
            except WireError as exc:   # unanswered for dead_after_s, or refused: a fresh link, try again
                if not unanswered:
                    worker.log.warning("swa_registry.unreachable", registry=worker.settings.swa_registry,
                                       code=exc.code.name)
                unanswered += 1
                worker.drop_link(worker.settings.swa_registry)   # whatever was queued to it may be lost
                self._reregister_due = True
                pause, backoff = backoff, next_backoff(backoff, cfg.heartbeat_s)
            except Exception:   # a bug, or the engine gone: log it, check in again next interval
                worker.log.exception("swa_registry.check_in_failed")
                pause = cfg.heartbeat_s - (loop.time() - started)
            await asyncio.sleep(max(0.0, pause))

    async def _checked_in(self, ack) -> None:
        restarted = bool(self.registry_incarnation) and ack.registry_incarnation != self.registry_incarnation
        self.registry_incarnation = ack.registry_incarnation
        if ack.known and not self._reregister_due:
            return
        self._reregister_due = False
        held = await self.worker.engine(held_states)
        self.advertise(held)
        self.reregistrations += 1
        if held or restarted:
            self.worker.log.info("swa_registry.registered_again", states=len(held), registry_restarted=restarted,
                                 registry_incarnation=ack.registry_incarnation)
