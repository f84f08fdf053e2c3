"""The link from a service to the one that feeds it: register (the ready handshake), heartbeat
with load every interval, and reconnect with back-off when the upstream stops answering
(a liveness counter, as in zguide's Paranoid Pirate). The back-off stops growing at one heartbeat:
each Register already waits dead_after_s for its answer, so a longer pause would only leave a
restarted router without its workers for seconds after it came back.

Register carries the model identity the service serves (Service.model_id); an upstream whose live
workers serve another refuses it (MODEL_MISMATCH, logged here as `upstream.registration_refused`)
and it tries again on the same back-off, so it joins once its pool has changed model. Registered
and each HeartbeatAck name the identity the upstream serves: `model_id` keeps the last one named."""
from __future__ import annotations

import asyncio
import os

from messages import WireError
from messages.control import Heartbeat, Register, Registered
from messages.errors import ErrorCode


BACKOFF_START_S = 0.25
BACKOFF_MAX_S = 8.0


def next_backoff(backoff: float, heartbeat_s: float) -> float:
    """The pause after `backoff` before the next try: doubled, and no longer than one heartbeat."""
    return min(backoff * 2, BACKOFF_MAX_S, max(heartbeat_s, BACKOFF_START_S))


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
        self.model_id = ""             # the identity the upstream last named; kept while its pool is empty

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
                if exc.code == ErrorCode.MODEL_MISMATCH:
                    svc.log.error("upstream.registration_refused", upstream=self.address, model_id=svc.model_id,
                                  error=exc.message, retry_in_s=backoff)
                else:
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
            backoff = next_backoff(backoff, svc.config.heartbeat_s)

    async def _register(self) -> None:
        svc, cfg = self.service, self.service.config
        register = Register(svc.kind, cfg.instance, cfg.advertise, os.getpid(), model_id=svc.model_id)
        reply = await svc.call(self.address, register,
                               timeout=cfg.ready_timeout_s if not self.reconnects else cfg.dead_after_s)
        registered: Registered = reply.message
        self.learn(registered.model_id)
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
                self.learn(reply.message.model_id)
                if not reply.message.known:
                    svc.log.warning("upstream.forgot_us", upstream=self.address)
                    return
            except WireError:
                missed += 1
            await asyncio.sleep(max(0.0, cfg.heartbeat_s - (loop.time() - started)))
        svc.log.warning("upstream.lost", upstream=self.address, missed=missed)

    def learn(self, model_id: str) -> None:
        """Keep the identity the upstream names; "" (its pool is empty for now) keeps the last one."""
        if model_id and model_id != self.model_id:
            self.service.log.info("upstream.model_identity", upstream=self.address, model_id=model_id,
                                  previous=self.model_id or None)
            self.model_id = model_id
