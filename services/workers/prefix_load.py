"""PrefixLoader: a prefill worker puts the routed hit into its engine's prefix cache.

The router sends the probe boundary (L1, the store's block-KV hit, capped at L - 134). Prefill
resumes at a block boundary only with the window state there (the last 128 tokens' KV + tails), so:
  - this engine already holds the pages and the state up to the probe: nothing to load;
  - else the pages come from the KV store (read here, StoreReader on kv_store_dir, or KvReadPages
    through the KV writer) while, at the same time, ONE SwaFetch to the SWA registry asks for the
    window at the probe, else at the probe - 128 (L1, else L1 - 128); the registry forwards
    it to the holder, which answers here directly. No holder: only the windows this engine holds.
    An engine with bounded replay (V4.1) takes the pages up to the probe even without a window there:
    it recomputes the last block to rebuild the window (bounded replay), so no hit drops to 0.
Every failure (store unreadable, holder gone, timeout) only shortens the hit; none fails the request.

The local check runs on the engine thread while the store read and the window fetch are under way
(a local hit cancels them); what was read goes into the engine with the request itself, in one
engine-thread call (`EngineCore.admit`, engine/admission.py), where an import the engine refuses
still admits the request with what is usable.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from engine.admission import Admitted, PrefixImport
from messages.errors import WireError
from messages.handoff import BufferRole, KVSnapshot, SwaFetch
from messages.kv_store import KvReadPages
from messages.prefix import BLOCK_TOKENS
from services.prefill_router.hit_length import hit_cap, hit_length
from services.runtime.tracing import SpanContext
from services.workers.tensors import torch_frame, torch_view


def _usable_prefix(engine, hashes: list[bytes]) -> int:
    """Prefix tokens this engine can already serve from its cache for the chain (pages + state)."""
    return engine.kv.usable_prefix(hashes)


@dataclass(slots=True)
class HitPlan:
    usable: int                          # prompt tokens this engine's cache serves as it is
    prefix: PrefixImport | None = None   # what to import with the request (nothing to: None)


class PrefixLoader:
    def __init__(self, worker):
        self.worker = worker     # the PrefillWorker: settings, engine(), call(), log
        self.reader = None

    def open(self) -> None:
        if self.worker.settings.kv_store_dir:
            from kvstore.reader import StoreReader
            self.reader = StoreReader(self.worker.settings.kv_store_dir,
                                      log=self.worker.log.bind(component="kv_store_reader"))

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()

    async def plan(self, request, probe: int, rid: str, span: SpanContext) -> HitPlan:
        """What the engine can use of the routed hit without an import, and what to import with the
        request (`EngineCore.admit`)."""
        worker = self.worker
        blocks = probe // BLOCK_TOKENS
        hashes = list(request.block_hashes[:blocks])
        if probe <= 0 or probe % BLOCK_TOKENS or probe > hit_cap(len(request.prompt_ids)) or len(hashes) < blocks:
            if probe:
                worker.log.warning("kv_hit.ignored", request_id=rid, kv_hit_tokens=probe,
                                   hint="not a block boundary within L - 134 of this prompt's hash chain")
            return HitPlan(0)
        boundaries = [hashes[b // BLOCK_TOKENS - 1] for b in (probe, probe - BLOCK_TOKENS) if b > 0]
        reads = asyncio.gather(self._read_pages(hashes, rid, span), self._fetch_window(boundaries, rid, span))
        try:
            local = await worker.engine(_usable_prefix, hashes)
            if local >= probe:
                return HitPlan(local)
            pages, state = await reads
        finally:
            if not reads.done():
                reads.cancel()
                reads.add_done_callback(lambda done: done.cancelled() or done.exception())
        at_probe = state is not None and state[0].block_hashes[0] == hashes[-1]
        upto = hit_length(len(request.prompt_ids), probe, at_probe) // BLOCK_TOKENS   # L1, else L1 - 128
        if getattr(worker, "bounded_replay", False):
            upto = blocks   # the engine replays the last block when no window is there
        pages = pages[:upto]
        if not pages:
            return HitPlan(local)
        if state is not None and state[0].num_tokens <= local:
            state = None   # this engine holds that window already (asked before the local check came back)
        boundary = state if state is not None and len(pages) == upto else None
        return HitPlan(local, PrefixImport(hashes[: len(pages)], [[p] for p in pages], boundary))

    def report(self, plan: HitPlan, admitted: Admitted, rid: str) -> int:
        """Log the import `admit` made of `plan`; the prompt tokens the engine takes from its cache."""
        if plan.prefix is None:
            return plan.usable
        if admitted.import_error:
            self.worker.log.warning("import_prefix.failed", request_id=rid, error=admitted.import_error)
            return admitted.usable_tokens
        self.worker.log.info("prefix.imported", request_id=rid, blocks=len(plan.prefix.pages),
                             with_state=plan.prefix.boundary_state is not None, usable_tokens=admitted.usable_tokens)
        return admitted.usable_tokens

    async def _read_pages(self, hashes: list[bytes], rid: str, span: SpanContext) -> list:
        worker = self.worker
        try:
            if self.reader is not None:
                reader, layout = self.reader, worker.layout
                found = await asyncio.get_running_loop().run_in_executor(None, lambda: reader.read(hashes, layout=layout))
                return [torch_view(*page) for page in found]
            if not worker.settings.kv_writer:
                return []
            pages: list = []
            while len(pages) < len(hashes):   # a reply holds at most the writer's max_read_bytes
                envelope = await worker.call(worker.settings.kv_writer, KvReadPages(hashes[len(pages):], worker.layout),
                                             request_id=rid, span=span, timeout=worker.settings.fetch_timeout_s)
                got = [torch_frame(envelope, i) for i in envelope.message.page_frames[: envelope.message.found]]
                if not got:
                    break
                pages += got
            return pages
        except WireError as exc:
            worker.log.warning("kv_read.failed", request_id=rid, code=exc.code.name, error=exc.message)
            return []

    async def _fetch_window(self, boundary_hashes: list[bytes], rid: str, span: SpanContext):
        """(header, [window, tails]) of the first boundary someone holds, or None. One call: the
        registry forwards it to the holder, whose answer lands here as its reply."""
        worker = self.worker
        if not boundary_hashes or not worker.settings.swa_registry:
            return None
        try:
            envelope = await worker.call(worker.settings.swa_registry,
                                         SwaFetch(boundary_hashes, reply_to=worker.config.advertise,
                                                  requester_incarnation=worker.incarnation),
                                         request_id=rid, span=span, timeout=worker.settings.fetch_timeout_s)
        except WireError as exc:
            worker.log.warning("swa_fetch.failed", request_id=rid, code=exc.code.name, error=exc.message)
            return None
        state = envelope.message
        if not state.found or state.prefix_hash not in boundary_hashes or not state.swa_frames or not state.tail_frames:
            worker.log.info("swa_fetch.miss", request_id=rid, asked=len(boundary_hashes))
            return None
        header = KVSnapshot(model_id=worker.model_id, num_tokens=state.num_tokens, block_hashes=[state.prefix_hash],
                            roles=[int(BufferRole.SWA), int(BufferRole.TAILS)])
        try:
            return header, [torch_frame(envelope, state.swa_frames[0]), torch_frame(envelope, state.tail_frames[0])]
        except WireError as exc:
            worker.log.warning("swa_fetch.bad_reply", request_id=rid, error=exc.message)
            return None
