"""Membership, heartbeat, lifecycle and diagnostics: between any service and the one that feeds
it (worker -> router), and between the `epd` command and any service.

A worker sends Register to its upstream and waits for Registered (the ready handshake), then a
Heartbeat every interval carrying its load; the upstream answers each with HeartbeatAck, so both
sides notice a dead peer. Register names the model identity the worker serves; an upstream refuses
(MODEL_MISMATCH) a worker whose identity differs from its live workers', and its Registered and
HeartbeatAck name the identity it serves, so a gateway learns it and never configures it.
StatusQuery/StatusReply serve `epd status` and health checks. Echo is a
diagnostic round trip (tensors included) used by `epd bench wire` and tests.
"""
from __future__ import annotations

from enum import IntEnum

import msgspec

from messages.registry import Message, register


class ServiceState(IntEnum):
    STARTING = 0
    RUNNING = 1
    DRAINING = 2
    STOPPED = 3


class Load(msgspec.Struct, array_like=True, gc=False):
    """What a service reports about how busy it is; routers choose by it."""

    queue_depth: int = 0
    in_flight: int = 0
    batch_size: int = 0
    kv_usage: float = 0.0         # fraction of KV pages in use, 0..1
    queued_tokens: int = 0        # prompt tokens waiting for prefill
    capacity: int = 0             # most concurrent requests it takes (0 = unbounded)


@register(0x0101)
class Register(Message):
    kind: str          # service kind, e.g. "decode_worker"
    instance: str      # unique instance name
    address: str       # where peers reach this instance
    pid: int = 0
    role: str = ""
    model_id: str = ""  # the model identity it serves (an engine's model_id); "" = it serves no model


@register(0x0102)
class Registered(Message):
    heartbeat_interval_s: float
    dead_after: int
    model_id: str = ""  # the identity the upstream serves, or its live workers announced; "" = none known yet


@register(0x0103)
class Heartbeat(Message):
    instance: str
    seq: int
    state: int = ServiceState.RUNNING
    load: Load = msgspec.field(default_factory=Load)


@register(0x0104)
class HeartbeatAck(Message):
    seq: int
    known: bool = True   # False: the upstream forgot us (restarted); register again
    model_id: str = ""   # as Registered.model_id, current: how a gateway learns the identity after it registered


@register(0x0105)
class StatusQuery(Message):
    pass


class PeerStatus(msgspec.Struct, array_like=True, gc=False):
    instance: str
    kind: str
    address: str
    alive: bool
    last_heartbeat_age_s: float
    load: Load = msgspec.field(default_factory=Load)
    state: int = ServiceState.RUNNING   # the peer's state from its last heartbeat
    model_id: str = ""                  # the identity it announced when it registered


@register(0x0106)
class StatusReply(Message):
    kind: str
    instance: str
    state: int
    pid: int
    uptime_s: float
    load: Load
    peers: list[PeerStatus] = []
    upstream: str = ""
    upstream_connected: bool = False
    incarnation: str = ""   # random per process: a restart at the same address answers with another
    model_id: str = ""      # as Registered.model_id
    depends_on: list[str] = []   # addresses of services it needs besides its members (a prefill router: its
                                 # decode router): a gateway's /ready asks them too


@register(0x0107)
class Drain(Message):
    """Ask a service to stop taking work and exit after in-flight work ends (or grace_s passes)."""

    grace_s: float = -1.0   # < 0: the service's configured grace period


@register(0x0108)
class Echo(Message):
    payload: bytes = b""
    delay_ms: float = 0.0   # diagnostic: hold the request this long before answering


@register(0x0109)
class EchoReply(Message):
    payload: bytes = b""
    handled_by: str = ""
