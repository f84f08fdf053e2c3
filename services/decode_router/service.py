"""DecodeRouterService: the decode pool's membership, published as a load table.

Decode workers (kind `worker_kind`) register with this router and heartbeat their Load (kv_usage =
fraction of KV pages in use, batch_size = requests running, capacity = most requests they take,
0 = no limit). Prefill routers ask DecodeTableQuery in the background and get DecodeTable: every
alive worker's last load, its state and the heartbeat's age, with the score's weights. They choose
the decode worker for each request locally (services/decode_router/core.py `rank`), so no request
waits on a round trip to this router.

Settings (ServiceConfig.settings): alpha, beta (see DecodePolicy), worker_kind (default
"decode_worker").
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from messages.routing import DecodeTable, DecodeTableQuery
from services.decode_router.core import DecodePolicy
from services.runtime.config import ServiceConfig
from services.runtime.context import Context
from services.runtime.service import Handler, Service
from services.runtime.settings import parse_settings


@dataclass(frozen=True, slots=True)
class DecodeRouterSettings:
    alpha: float = 1.0
    beta: float = 1.0
    worker_kind: str = "decode_worker"

    def __post_init__(self) -> None:
        DecodePolicy(self.alpha, self.beta)   # validates the weights
        if not self.worker_kind:
            raise ValueError("worker_kind must name the kind decode workers register as")


class DecodeRouterService(Service):
    kind = "decode_router"

    def __init__(self, config: ServiceConfig):
        self.settings = parse_settings(DecodeRouterSettings, config.settings, self.kind)
        self.tables_sent = 0
        super().__init__(config)
        self.metrics.counter("epd_decode_router_tables", "Load tables sent to prefill routers",
                             lambda: self.tables_sent)

    def handlers(self) -> dict[type, Handler]:
        return {DecodeTableQuery: self._on_table_query}

    def table(self) -> DecodeTable:
        now = time.monotonic()
        workers = [s for s in self.members.status(now) if s.alive and s.kind == self.settings.worker_kind]
        return DecodeTable(workers, self.settings.alpha, self.settings.beta)

    async def _on_table_query(self, msg: DecodeTableQuery, ctx: Context) -> DecodeTable:
        self.tables_sent += 1
        return self.table()

    async def on_start(self) -> None:
        s = self.settings
        self.log.info("decode_router.started", alpha=s.alpha, beta=s.beta, worker_kind=s.worker_kind)
