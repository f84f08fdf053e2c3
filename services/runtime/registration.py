"""The upstream's side of registration (Register -> Registered), and the model identity it names.

A worker announces the model identity it serves (Register.model_id, its engine's model_id). The
membership table refuses one whose identity differs from the live workers' of its kind (one pool,
one model): the worker gets a MODEL_MISMATCH error reply and this side logs `peer.refused`. Every
Registered, HeartbeatAck and StatusReply names the identity this service serves: its own (a
unified worker's), else its live workers' (a router's pool). That is how a gateway learns the
identity every block hash covers, instead of configuring it.
"""
from __future__ import annotations

import time

from messages.control import Register, Registered
from messages.errors import ModelMismatch


def served_model_id(service) -> str:
    """The service's own model identity, else its live registered workers'; "" while none is known."""
    return service.model_id or service.members.model_id()


def register_peer(service, msg: Register) -> Registered:
    """Record the peer (a restart replaces its entry) and answer; ModelMismatch refuses it."""
    try:
        service.members.register(msg.instance, msg.kind, msg.address, msg.role, time.monotonic(), msg.model_id)
    except ModelMismatch as exc:
        service.log.error("peer.refused", peer=msg.instance, peer_kind=msg.kind, address=msg.address,
                          error=exc.message)
        raise
    service.metrics.peers_alive.set(len(service.members.alive()))
    service.log.info("peer.registered", peer=msg.instance, peer_kind=msg.kind, address=msg.address,
                     model_id=msg.model_id or None)
    return Registered(service.config.heartbeat_s, service.config.dead_after, served_model_id(service))
