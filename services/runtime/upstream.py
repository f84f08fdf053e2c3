"""The link from a service to the one that feeds it: register (the ready handshake), heartbeat
with load every interval, and reconnect with back-off when the upstream stops answering
(a liveness counter, as in zguide's Paranoid Pirate). The back-off stops growing at one heartbeat:
each Register already waits dead_after_s for its answer, so a longer pause would only leave a
restarted router without its workers for seconds after it came back."""
from __future__ import annotations

import asyncio
import os

from messages import WireError
from messages.control import Heartbeat, Register, Registered


BACKOFF_START_S = 0.25
BACKOFF_MAX_S = 8.0


class UpstreamLink:
    def __init__(self, service, address: str = ""):
        self.service = service
        self.address = address or service.config.upstream   # default: the replica we send requests to
        self.primary = not address                          # the others only keep us registered there
        # the upstream's other replicas (an aide's other gateways), each on a link of its own
        self.others = [UpstreamLink(service, other) for other in service.config.upstream_replicas] if self.primary \
            else []
        self.connected = False
        self.ready = asyncio.Event()   # set while registered: what a request waiting for a restarted upstream awaits
        self.reconnects = 0

    async def run(self) -> None:
        """Stay registered with the upstream and with its other replicas (ServiceConfig.upstream_replicas)."""
        await asyncio.gather(self._stay_registered(), *(link._stay_registered() for link in self.others))

    async def _stay_registered(self) -> None:
        svc = self.service
        backoff = BACKOFF_START_S
        while True:
            try:
                await self._register()
                backoff = BACKOFF_START_S
                await self._heartbeat_until_lost()
            except WireError as exc:
                svc.log.warning("upstream.unreachable", upstream=self.address, error=exc.message,
                                retry_in_s=backoff)
            if self.connected:
                self.connected = False
                self.ready.clear()
                if self.primary:
                    svc.on_upstream_lost()
            svc.drop_link(self.address)    # LINGER 0: a fresh socket, nothing stale queued
            self.reconnects += 1
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S, max(svc.config.heartbeat_s, BACKOFF_START_S))

    async def _register(self) -> None:
        svc, cfg = self.service, self.service.config
        reply = await svc.call(self.address, Register(svc.kind, cfg.instance, cfg.advertise, os.getpid()),
                               timeout=cfg.ready_timeout_s if not self.reconnects else cfg.dead_after_s)
        registered: Registered = reply.message
        self.connected = True
        self.ready.set()
        svc.log.info("upstream.registered", upstream=self.address, heartbeat_s=registered.heartbeat_interval_s)

    async def _heartbeat_until_lost(self) -> None:
        svc, cfg = self.service, self.service.config
        seq, missed = 0, 0
        loop = asyncio.get_running_loop()
        while missed < cfg.dead_after:
            seq += 1
            started = loop.time()
            try:
                reply = await svc.call(self.address, Heartbeat(cfg.instance, seq, int(svc.state), svc.load()),
                                       timeout=cfg.heartbeat_s)
                missed = 0
                if not reply.message.known:
                    svc.log.warning("upstream.forgot_us", upstream=self.address)
                    return
            except WireError:
                missed += 1
            await asyncio.sleep(max(0.0, cfg.heartbeat_s - (loop.time() - started)))
        svc.log.warning("upstream.lost", upstream=self.address, missed=missed)
