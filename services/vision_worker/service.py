"""VisionWorkerService: one card's share of the vision pool (README.md).

VisionEncode (from its leader, the group's vision balancer) queues the images; a batcher cuts
batches of up to `max_batch_patches` and runs each through the encoder on a thread of its own (the
event loop keeps taking messages and heartbeating while the encoder runs); each image's span rows go
straight to the request's `reply_to` as VisionEncoded with one zero-copy frame, or VisionFailed
with a typed code. When a job has ended the worker tells its leader (VisionDone) so the leader's
count of its queued patches falls. VisionCancel drops a request's images not yet encoded.

Settings (ServiceConfig.settings): model_dir, device, dtype, max_batch_patches, max_queue_patches,
torch_threads, warmup.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from messages.control import Load
from messages.errors import ErrorCode, InvalidRequest, Overloaded, WireError
from messages.vision import (VisionCancel, VisionDone, VisionEncode, VisionEncoded, VisionFailed, images_from,
                             positions)
from services.runtime.config import ServiceConfig
from services.runtime.context import Context
from services.runtime.service import Handler, Service
from services.runtime.settings import parse_settings
from services.vision_worker.encode import BatchResult, Failure, encode_batch, warm_up
from services.vision_worker.metrics import VisionCounts, declare_metrics
from services.vision_worker.queue import Item, PatchQueue, WorkerJob
from services.vision_worker.settings import VisionWorkerSettings
from services.workers.tensors import to_frame


class VisionWorkerService(Service):
    kind = "vision_worker"
    continuation_types = (VisionCancel,)   # a draining worker still drops what its callers gave up on

    def __init__(self, config: ServiceConfig):
        self.settings = parse_settings(VisionWorkerSettings, config.settings, self.kind)
        super().__init__(config)
        self.encoder = None
        self.no_encoder = ""                 # why the model gave no encoder (images are then refused)
        self.queue = PatchQueue()
        self.counts = VisionCounts()
        self.batch_size = 0                  # images in the batch being encoded
        self._wake = asyncio.Event()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"vision-{config.instance}")
        self._batcher: asyncio.Task | None = None
        self._local_jobs = 0                 # ids for jobs sent here without a leader's id
        declare_metrics(self.metrics, self)

    def handlers(self) -> dict[type, Handler]:
        return {VisionEncode: self.on_encode, VisionCancel: self.on_cancel}

    def load_encoder(self):
        """The encoder this worker runs (on the encoder thread). Tests override it."""
        import torch

        from engine.models.v41.vision import VisionEncoder
        s = self.settings
        if s.torch_threads:
            torch.set_num_threads(s.torch_threads)
        return VisionEncoder.load(s.model_dir, device=s.device, dtype=getattr(torch, s.dtype))

    # ---- load --------------------------------------------------------------------------
    def in_flight(self) -> int:
        return self._active + len(self.queue.jobs)

    def load(self) -> Load:
        # queued_tokens: the work still to do, in this pool's unit (patches)
        return Load(queue_depth=len(self.queue), in_flight=self.in_flight(), batch_size=self.batch_size,
                    queued_tokens=self.queue.queued_patches)

    # ---- handlers ----------------------------------------------------------------------
    async def on_encode(self, msg: VisionEncode, ctx: Context) -> None:
        images = images_from(ctx.envelope)
        if self.no_encoder:
            raise InvalidRequest(f"{self.config.instance} cannot encode images: {self.no_encoder}",
                                 request_id=ctx.request_id)
        if not ctx.request_id or not msg.reply_to or not images:
            raise InvalidRequest("VisionEncode needs a request id, a reply_to and at least one image",
                                 request_id=ctx.request_id)
        patches = sum(image.grid.patches for image in images)
        if self.queue.queued_patches and self.queue.queued_patches + patches > self.settings.max_queue_patches:
            raise Overloaded(f"{self.config.instance} has {self.queue.queued_patches} patches queued "
                             f"(max_queue_patches {self.settings.max_queue_patches})", request_id=ctx.request_id)
        job_id = msg.job
        if not job_id:
            self._local_jobs += 1
            job_id = f"local-{self._local_jobs}"
        job = WorkerJob(job_id, ctx.request_id, msg.reply_to, attempt=msg.attempt,
                        from_leader=bool(msg.job), span=ctx.span)
        self.queue.add(job, list(zip(positions(msg), images)))
        self.log.info("vision.queued", job=job_id, images=len(images), patches=patches,
                      queue_patches=self.queue.queued_patches)
        self._wake.set()

    async def on_cancel(self, msg: VisionCancel, ctx: Context) -> None:
        ended, dropped = self.queue.cancel(ctx.request_id, msg.job)
        self.counts.cancelled += dropped
        for job in ended:
            self._job_ended(job)

    # ---- the batcher -------------------------------------------------------------------
    async def _run_batches(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            batch = self.queue.take_batch(self.settings.max_batch_patches)
            if not batch:
                self._wake.clear()
                continue
            self.batch_size = len(batch)
            try:
                result = await loop.run_in_executor(self._thread, encode_batch, self.encoder,
                                                    [item.image for item in batch])
            finally:
                self.batch_size = 0
            self._deliver(batch, result)

    def _deliver(self, batch: list[Item], result: BatchResult) -> None:
        counts = self.counts
        counts.batches += 1
        counts.encode.observe(result.encode_s)
        counts.preprocess.observe(result.preprocess_s)
        encode_ms = round(result.encode_s * 1e3, 3)
        for item, output in zip(batch, result.outputs):
            outcome = self._send_one(item, output, encode_ms)
            ended = self.queue.resolve(item, outcome)
            if ended is not None:
                self._job_ended(ended)
        self.log.info("vision.batch", images=len(batch), patches=sum(item.patches for item in batch),
                      encode_ms=encode_ms, preprocess_ms=round(result.preprocess_s * 1e3, 3),
                      queue_patches=self.queue.queued_patches)

    def _send_one(self, item: Item, output, encode_ms: float) -> str:
        """Send one image's answer to its reply_to; its outcome for the job's tally."""
        job, counts = item.job, self.counts
        if job.dropped:
            counts.cancelled += 1
            return "cancelled"
        span = job.span
        try:
            if isinstance(output, Failure):
                counts.failed += 1
                self.log.warning("vision.image_failed", request_id=job.request_id, index=item.position,
                                 code=ErrorCode(output.code).name, error=output.message[:200])
                self.send(job.reply_to, VisionFailed(item.position, int(output.code), output.message, job.attempt),
                          request_id=job.request_id, span=span)
                return "failed"
            self.send(job.reply_to, VisionEncoded(item.position, bytes(item.image.digest), encode_ms, job.attempt),
                      request_id=job.request_id, span=span, buffers=[to_frame(output)])
        except WireError as exc:   # the prefill worker is gone or full: its request cannot use the rows
            counts.undeliverable += 1
            self.log.warning("vision.undeliverable", request_id=job.request_id, reply_to=job.reply_to,
                             code=exc.code.name)
            return "failed"
        counts.images += 1
        counts.patches += item.patches
        return "encoded"

    def _job_ended(self, job: WorkerJob) -> None:
        if not (job.from_leader and self.config.upstream):
            return
        try:
            self.send(self.config.upstream, VisionDone(job.id, job.patches, job.encoded, job.failed, job.cancelled),
                      request_id=job.request_id)
        except WireError as exc:   # the leader is unreachable: it re-learns our queue when it sees us again
            self.log.warning("vision.done_undeliverable", job=job.id, code=exc.code.name)

    # ---- lifecycle ---------------------------------------------------------------------
    async def on_start(self) -> None:
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        from engine.models.v41.vision import NoVisionEncoder   # torch only in this process, not where it is imported
        try:
            self.encoder = await loop.run_in_executor(self._thread, self.load_encoder)
        except NoVisionEncoder as exc:
            # A stack serving a model without vision (a V4 model on the default topology) still starts:
            # its gateway refuses images, and this worker refuses any it is sent.
            self.log.warning("vision_worker.no_encoder", model_dir=self.settings.model_dir, error=str(exc))
            self.no_encoder = str(exc)
            return
        warmup_s = await loop.run_in_executor(self._thread, warm_up, self.encoder) if self.settings.warmup else 0.0
        self._batcher = loop.create_task(self._run_batches())
        self._batcher.add_done_callback(self._batcher_ended)
        s = self.settings
        self.log.info("vision_worker.started", model_dir=s.model_dir, device=s.device, dtype=s.dtype,
                      hidden_size=getattr(self.encoder, "hidden_size", None),
                      max_batch_patches=s.max_batch_patches, warmup_ms=round(warmup_s * 1e3, 3),
                      load_s=round(time.monotonic() - started, 3))

    def _batcher_ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:   # a bug: serving on would hang every request
            self.failure = f"the batcher failed: {task.exception()!r}"
            self.log.error("vision.batcher_failed", error=self.failure)
            self.stop()

    async def on_stop(self) -> None:
        if self._batcher is not None:
            self._batcher.cancel()
            await asyncio.gather(self._batcher, return_exceptions=True)
        # a batch still encoding is abandoned: its thread ends with it, nobody waits for it
        self._thread.shutdown(wait=False, cancel_futures=True)
