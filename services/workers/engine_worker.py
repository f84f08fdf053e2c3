"""EngineWorker: what every GPU worker is — one EngineCore on its EngineThread, its settings and
load, the window states it serves to peers (SwaFetch) and advertises, and its completed blocks
persisted (BlockPersister). The roles build on it: PrefillWorker (prefill.py), and through
StreamingWorker (streaming.py) the DecodeWorker and the UnifiedWorker.

Settings (ServiceConfig.settings): every EngineConfig field (model_dir, dtype, num_pages, ...) plus
  kv_writer      address of the KV writer ("" = no block persistence / no KvReadPages)
  kv_store_dir   the store directory to read pages from directly (StoreReader); "" = KvReadPages
  swa_registry   address of the SWA registry ("" = window states are neither advertised nor fetched)
  swa_ttl_s      TTL of the registrations (DeepSeek's: ~180 s)
  handoff_timeout_s, fetch_timeout_s   timeouts of StateHandoff and SwaFetch / KvReadPages calls
  grammar_timeout_s  how long a constrained request waits for its grammar from the compiler
  vision_timeout_s   how long a request with images waits for their embeddings from one vision group
  capacity       requests this worker takes at once (0 = the engine's max_num_seqs)
"""
from __future__ import annotations

import asyncio
import time

from messages import ErrorReply
from messages.control import Load
from messages.handoff import KV_LAYOUT_VERSION, SwaFetch, SwaState
from messages.errors import WireError
from services.runtime.context import Context
from services.runtime.service import Service
from services.runtime.settings import parse_settings
from services.workers.engine_thread import EngineThread
from services.workers.grammar import GrammarSource
from services.workers.images import ImageRows
from services.workers.persist import BlockPersister
from services.workers.settings import ENGINE_KEYS, WorkerSettings  # noqa: F401 - ENGINE_KEYS: tests read it here
from services.workers.tensors import to_frame


def page_layout(engine) -> str:
    """The layout tag stored with each page (the hash chain already names the model and dtype)."""
    dtype = str(engine.kv.pool.pages.dtype).removeprefix("torch.")
    return f"kv-v{KV_LAYOUT_VERSION}/{dtype}/{engine.kv.layout.page_numel}"


def _first_boundary_state(engine, hashes: list[bytes]):
    """On the engine thread: (hash, exported state) of the first of `hashes` held here, or None."""
    for h in hashes:
        exported = engine.export_boundary_state(h)
        if exported is not None:
            return h, exported
    return None


class EngineWorker(Service):
    kind = "engine_worker"

    def __init__(self, config):
        self.settings = parse_settings(WorkerSettings, config.settings, self.kind)
        self.images = ImageRows(self, self.settings.vision_timeout_s)   # before Service.__init__ reads handlers()
        super().__init__(config)
        self.engine_thread: EngineThread | None = None
        self.engine_stats = None
        self.model_id = ""
        self.layout = ""
        self.max_num_seqs = 0
        self.persister = BlockPersister(self)
        self.grammars = GrammarSource(self)
        self._loops: list[asyncio.Task] = []

    after_step = None   # a subclass's fn(engine, outputs), run on the engine thread after each step (EngineThread)

    def base_handlers(self):
        return {SwaFetch: self._on_swa_fetch, ErrorReply: self._on_error_reply, **self.images.handlers()}

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
        self.engine_stats = engine.stats()
        self.model_id = engine.model_id
        self.layout = page_layout(engine)
        self.max_num_seqs = engine_config.max_num_seqs
        self.bounded_replay = engine.kv.replay   # V4.1: pages without a window state still make a hit
        self.start_loop(self.persister.run())
        self.grammars.open(engine_config.model_dir, engine.model.config.vocab_size, engine.model.config.eos_token_ids)
        self.log.info("engine.loaded", model_dir=engine_config.model_dir, model_id=engine.model_id,
                      load_s=round(time.monotonic() - started, 3), pages=self.engine_stats.pages_total,
                      kv_writer=self.settings.kv_writer or None, swa_registry=self.settings.swa_registry or None)

    def start_loop(self, coro) -> None:
        """A loop that lives as long as the worker (cancelled at stop)."""
        self._loops.append(asyncio.get_running_loop().create_task(coro))

    async def on_stop(self) -> None:
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        if self.engine_thread is not None:
            self.engine_thread.stop()

    def capacity(self) -> int:
        return self.settings.capacity or self.max_num_seqs

    def load(self) -> Load:
        stats = self.engine_stats
        return Load(queue_depth=stats.num_waiting if stats else 0, in_flight=self.in_flight(),
                    batch_size=stats.num_running if stats else 0, kv_usage=stats.kv_usage if stats else 0.0,
                    capacity=self.capacity())

    # ---- to override -------------------------------------------------------------------
    def _on_outputs(self, outputs: list, after: object = None) -> None:
        raise NotImplementedError

    def _on_engine_failure(self, exc: Exception) -> None:
        raise NotImplementedError

    async def engine(self, fn, *args):
        """Run fn(engine, *args) on the engine thread between steps."""
        return await self.engine_thread.call(fn, *args)

    def stats_after_step(self) -> None:
        """Read the engine's counters (cheap) on the loop right after a step delivered outputs."""
        self.engine_stats = self.engine_thread.engine.stats()

    async def refresh_stats(self) -> None:
        self.engine_stats = await self.engine(lambda engine: engine.stats())

    async def abort_in_engine(self, request_id: str) -> None:
        await self.engine(lambda engine, rid: engine.abort(rid), request_id)
        await self.refresh_stats()

    # ---- SWA states: serve ------------------------------------------------------------------
    async def _on_swa_fetch(self, msg: SwaFetch, ctx: Context) -> None:
        """The first asked boundary state held here. Forwarded by the SWA registry (reply_msg_id
        set): the answer goes straight to the requester as the reply to its own call."""
        found = await self.engine(_first_boundary_state, list(msg.prefix_hashes))
        state, buffers = SwaState(found=False), []
        if found is not None:
            block_hash, (header, (window, tails)) = found
            state = SwaState(True, header.num_tokens, [0], [1], block_hash)
            buffers = [to_frame(window), to_frame(tails)]
        if msg.reply_msg_id and msg.reply_to:
            try:
                self.send(msg.reply_to, state, request_id=ctx.request_id, span=ctx.span, buffers=buffers,
                          in_reply_to=msg.reply_msg_id)
            except WireError as exc:
                self.log.warning("swa_state.undeliverable", to=msg.reply_to, code=exc.code.name)
            return
        ctx.reply(state, buffers=buffers)

    async def _on_error_reply(self, msg: ErrorReply, ctx: Context) -> None:
        self.log.warning("peer.error", request_id=ctx.request_id or None, sender=ctx.sender, code=msg.code,
                         error=msg.message)
