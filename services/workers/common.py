"""What the prefill and decode workers share: settings, the engine on its thread, serving the SWA
boundary states the engine holds (SwaFetch), advertising them (SwaRegister), and persisting
completed blocks (KvWritePages). Both are fire-and-forget sends; their acks land in no-op handlers.

Settings (ServiceConfig.settings): every EngineConfig field (model_dir, dtype, num_pages, ...) plus
  kv_writer      address of the KV writer ("" = no block persistence / no KvReadPages)
  kv_store_dir   the store directory to read pages from directly (StoreReader); "" = KvReadPages
  swa_registry   address of the SWA registry ("" = boundary states are not advertised)
  swa_ttl_s      TTL of the registrations (seeds: ~180 s)
  handoff_timeout_s, fetch_timeout_s   timeouts of StateHandoff and SwaFetch / KvReadPages calls
  capacity       requests this worker takes at once (0 = the engine's max_num_seqs)
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Mapping

from messages import ErrorReply
from messages.common import TrafficClass
from messages.errors import WireError
from messages.handoff import KV_LAYOUT_VERSION, SwaFetch, SwaState
from messages.kv_store import KvWriteAck, KvWritePages
from messages.swa_registry import SwaAck, SwaRegister
from services.runtime.context import Context
from services.runtime.service import Service
from services.runtime.tracing import SpanContext
from services.workers.engine_thread import EngineThread

WRITE_BATCH_BLOCKS = 256   # pages per KvWritePages / hashes per SwaRegister (both services cap a message)
ENGINE_KEYS = ("model_dir", "device", "dtype", "num_pages", "max_num_seqs", "max_batched_tokens",
               "enable_prefix_cache", "batch_invariant", "max_model_len", "swa_cache_bytes", "cuda_graphs",
               "torch_threads")   # engine.engine_core.EngineConfig's fields (a test keeps them equal)


@dataclass(slots=True, frozen=True)
class WorkerSettings:
    engine: dict
    kv_writer: str = ""
    kv_store_dir: str = ""
    swa_registry: str = ""
    swa_ttl_s: float = 180.0
    handoff_timeout_s: float = 30.0
    fetch_timeout_s: float = 5.0
    capacity: int = 0

    def __post_init__(self) -> None:
        for name in ("swa_ttl_s", "handoff_timeout_s", "fetch_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive finite number")
        if not isinstance(self.capacity, int) or self.capacity < 0:
            raise ValueError("capacity must be an int >= 0")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "WorkerSettings":
        own = {f.name for f in dataclasses.fields(cls)} - {"engine"}
        unknown = set(values) - own - set(ENGINE_KEYS)
        if unknown:
            raise ValueError(f"unknown worker settings: {sorted(unknown)}")
        return cls({k: v for k, v in values.items() if k in ENGINE_KEYS},
                   **{k: v for k, v in values.items() if k in own})


def page_layout(engine) -> str:
    """The layout tag stored with each page (the hash chain already names the model and dtype)."""
    dtype = str(engine.kv.pool.pages.dtype).removeprefix("torch.")
    return f"kv-v{KV_LAYOUT_VERSION}/{dtype}/{engine.kv.layout.page_numel}"


def _collect_blocks(engine, request_id: str, first_block: int):
    """On the engine thread: full blocks from `first_block` on, and which of them have a saved
    boundary state here (window + tails at the block's end)."""
    try:
        blocks = engine.completed_blocks(request_id, first_block)
    except ValueError:
        return [], []
    boundaries = engine.kv.boundaries
    return blocks, [h for h, _ in blocks if h in boundaries]


class EngineWorker(Service):
    """Base of the prefill and decode workers: one EngineCore on an EngineThread."""

    kind = "engine_worker"

    def __init__(self, config):
        self.settings = WorkerSettings.from_mapping(config.settings)
        super().__init__(config)
        self.engine_thread: EngineThread | None = None
        self._engine_stats = None
        self.model_id = ""
        self.layout = ""
        self.max_num_seqs = 0
        self._persist_queue: asyncio.Queue | None = None
        self._persist_queued: set[str] = set()
        self._blocks_sent: dict[str, int] = {}
        self._persist_done: set[str] = set()    # finished: forget once persisted
        self._persist_meta: dict[str, tuple[int, SpanContext | None]] = {}
        self._persister: asyncio.Task | None = None
        self.blocks_persisted = 0
        self.states_registered = 0

    after_step = None   # a subclass's fn(engine, outputs), run on the engine thread after each step (EngineThread)

    def base_handlers(self):
        return {SwaFetch: self._on_swa_fetch, KvWriteAck: self._on_ack, SwaAck: self._on_ack,
                ErrorReply: self._on_error_reply}

    # ---- lifecycle ---------------------------------------------------------------------
    async def on_start(self) -> None:
        from engine.engine_core import EngineConfig, EngineCore   # torch only in worker processes
        engine_config = EngineConfig(**self.settings.engine)
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        engine = await loop.run_in_executor(None, EngineCore, engine_config)
        self.engine_thread = EngineThread(engine, self._on_outputs, self._on_engine_failure, loop,
                                          name=f"engine-{self.config.instance}", after_step=self.after_step)
        self.engine_thread.start()
        self._engine_stats = engine.stats()
        self.model_id = engine.model_id
        self.layout = page_layout(engine)
        self.max_num_seqs = engine_config.max_num_seqs
        self._persist_queue = asyncio.Queue()
        self._persister = loop.create_task(self._persist_loop())
        self.log.info("engine.loaded", model_dir=engine_config.model_dir, model_id=engine.model_id,
                      load_s=round(time.monotonic() - started, 3), pages=self._engine_stats.pages_total,
                      kv_writer=self.settings.kv_writer or None, swa_registry=self.settings.swa_registry or None)

    async def on_stop(self) -> None:
        if self._persister is not None:
            self._persister.cancel()
            await asyncio.gather(self._persister, return_exceptions=True)
        if self.engine_thread is not None:
            self.engine_thread.stop()

    def capacity(self) -> int:
        return self.settings.capacity or self.max_num_seqs

    # ---- to override -------------------------------------------------------------------
    def _on_outputs(self, outputs: list) -> None:
        raise NotImplementedError

    def _on_engine_failure(self, exc: Exception) -> None:
        raise NotImplementedError

    async def engine(self, fn, *args):
        """Run fn(engine, *args) on the engine thread between steps."""
        return await self.engine_thread.call(fn, *args)

    async def refresh_stats(self) -> None:
        self._engine_stats = await self.engine(lambda engine: engine.stats())

    # ---- SWA states: serve and advertise ------------------------------------------------
    async def _on_swa_fetch(self, msg: SwaFetch, ctx: Context) -> None:
        exported = await self.engine(lambda engine, h: engine.export_boundary_state(h), msg.prefix_hash)
        if exported is None:
            ctx.reply(SwaState(found=False))
            return
        header, (window, tails) = exported
        ctx.reply(SwaState(found=True, num_tokens=header.num_tokens, swa_frames=[0], tail_frames=[1]),
                  buffers=[window, tails])

    def advertise_states(self, hashes: list[bytes], request_id: str = "", span: SpanContext | None = None) -> None:
        if not hashes or not self.settings.swa_registry:
            return
        hashes = list(hashes)
        for start in range(0, len(hashes), WRITE_BATCH_BLOCKS):
            batch = hashes[start : start + WRITE_BATCH_BLOCKS]
            try:
                message = SwaRegister(batch, self.config.advertise, self.settings.swa_ttl_s)
                self.send(self.settings.swa_registry, message, request_id=request_id, span=span)
                self.states_registered += len(batch)
            except WireError as exc:
                self.log.warning("swa_register.undeliverable", request_id=request_id or None, code=exc.code.name)
                return

    async def _on_ack(self, msg, ctx: Context) -> None:
        return None

    async def _on_error_reply(self, msg: ErrorReply, ctx: Context) -> None:
        self.log.warning("peer.error", request_id=ctx.request_id or None, sender=ctx.sender, code=msg.code,
                         error=msg.message)

    # ---- completed blocks -> KV writer (and their boundary states -> SWA registry) ------------
    def persist_blocks(self, request_id: str, span: SpanContext | None, traffic_class: int,
                       finished: bool = False) -> None:
        """Queue a look for the request's new full blocks; never blocks the caller or a step."""
        if finished:
            self._persist_done.add(request_id)
        self._persist_meta.setdefault(request_id, (traffic_class, span))
        if request_id not in self._persist_queued:
            self._persist_queued.add(request_id)
            self._persist_queue.put_nowait(request_id)

    async def _persist_loop(self) -> None:
        while True:
            request_id = await self._persist_queue.get()
            self._persist_queued.discard(request_id)
            try:
                await self._persist_one(request_id)
            except asyncio.CancelledError:
                raise
            except Exception:   # a bug here must not stop persistence for good
                self.log.exception("persist.failed", request_id=request_id)
            if request_id in self._persist_done and request_id not in self._persist_queued:
                self._persist_done.discard(request_id)
                self._blocks_sent.pop(request_id, None)
                self._persist_meta.pop(request_id, None)

    async def _persist_one(self, request_id: str) -> None:
        first = self._blocks_sent.get(request_id, 0)
        blocks, states = await self.engine(_collect_blocks, request_id, first)
        if not blocks:
            return
        self._blocks_sent[request_id] = first + len(blocks)
        traffic_class, span = self._persist_meta.get(request_id, (int(TrafficClass.CHATBOT), None))
        for start in range(0, len(blocks) if self.settings.kv_writer else 0, WRITE_BATCH_BLOCKS):
            batch = blocks[start : start + WRITE_BATCH_BLOCKS]
            message = KvWritePages([h for h, _ in batch], list(range(len(batch))), self.layout, traffic_class)
            try:
                self.send(self.settings.kv_writer, message, request_id=request_id, span=span,
                          buffers=[page for _, (page,) in batch])
                self.blocks_persisted += len(batch)
            except WireError as exc:
                self.log.warning("kv_write.undeliverable", request_id=request_id, code=exc.code.name)
                break
        self.advertise_states(states, request_id, span)
