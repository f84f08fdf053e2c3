"""Test-only: a worker that holds window states without an engine, advertised and kept registered by
the real BlockPersister (services/workers/persist.py), so registry restarts can be tested in
seconds, in-process or as a process (kind
"tests.swa_registry.test_helper_window_holder:TestHelperWindowHolder").

Settings: swa_registry (address), held (hex hashes of the window states it holds from the start).
It stands in for the engine itself (`engine(fn)` runs fn on this object, whose `kv.boundaries.states`
are the held hashes) and answers a forwarded SwaFetch for a held hash like a worker does."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from messages.handoff import SwaFetch, SwaState
from services.runtime.service import Service
from services.workers.persist import BlockPersister


class TestHelperWindowHolder(Service):
    kind = "prefill_worker"
    __test__ = False

    def __init__(self, config):
        super().__init__(config)
        values = config.settings
        self.settings = SimpleNamespace(swa_registry=values["swa_registry"], kv_writer="",
                                        swa_ttl_s=float(values.get("swa_ttl_s", 180.0)))
        held = dict.fromkeys(bytes.fromhex(x) for x in values.get("held", []))
        self.kv = SimpleNamespace(boundaries=SimpleNamespace(states=held))
        self.persister = BlockPersister(self)
        self.fetches: list[SwaFetch] = []
        self._persisting: asyncio.Task | None = None

    def handlers(self):
        return {SwaFetch: self._on_fetch}

    async def engine(self, fn, *args):
        return fn(self, *args)

    def hold(self, hashes: list[bytes]) -> None:
        """Compute windows (as a prefill does) and advertise them."""
        self.kv.boundaries.states.update(dict.fromkeys(hashes))
        self.persister.advertise(hashes)

    async def on_start(self) -> None:
        self._persisting = asyncio.get_running_loop().create_task(self.persister.run())

    async def on_stop(self) -> None:
        if self._persisting is not None:
            self._persisting.cancel()
            await asyncio.gather(self._persisting, return_exceptions=True)

    async def _on_fetch(self, msg: SwaFetch, ctx) -> None:
        self.fetches.append(msg)
        held = next((h for h in msg.prefix_hashes if h in self.kv.boundaries.states), None)
        state = SwaState(True, num_tokens=128, prefix_hash=held) if held is not None else SwaState(False)
        self.send(msg.reply_to, state, request_id=ctx.request_id, in_reply_to=msg.reply_msg_id)
