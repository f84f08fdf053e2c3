"""BlockPersister: a worker's completed 128-token blocks go to the KV writer (KvWritePages) and the
window states it saved at their ends are advertised to the SWA registry (SwaRegister). Both are
one-way notifications (the services answer only on error), batched, never blocking a step: a
request is queued for a look and one background loop collects its new blocks on the engine thread.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from messages.errors import WireError
from messages.kv_store import KvWritePages
from messages.swa_registry import SwaRegister
from services.runtime.tracing import SpanContext
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
        """Register window states this worker holds (holder = its advertised address)."""
        worker = self.worker
        if not hashes or not worker.settings.swa_registry:
            return
        hashes = list(hashes)
        for start in range(0, len(hashes), WRITE_BATCH_BLOCKS):
            batch = hashes[start : start + WRITE_BATCH_BLOCKS]
            try:
                worker.send(worker.settings.swa_registry,
                            SwaRegister(batch, worker.config.advertise, worker.settings.swa_ttl_s),
                            request_id=request_id, span=span)
                self.states_registered += len(batch)
            except WireError as exc:
                worker.log.warning("swa_register.undeliverable", request_id=request_id or None, code=exc.code.name)
                return
