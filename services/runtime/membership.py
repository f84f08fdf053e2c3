"""Who is registered with this service, who is still alive, and which work each peer holds.

Pure and clock-injected: the shell calls `expire(now)` periodically and acts on the result.

One model identity per pool: a peer that announces a model identity (an engine worker's model_id)
is refused (ModelMismatch) while a live peer of its kind serves another, since the block hashes,
the KV store's pages and the hand-offs of one pool must all mean the same model. A restarted
instance is compared with the others, not with its former self, and a pool whose workers all died
takes a new identity (a model swap).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from messages.control import Load, PeerStatus, ServiceState
from messages.errors import ModelMismatch


@dataclass(slots=True)
class Peer:
    instance: str
    kind: str
    address: str
    role: str
    last_seen: float
    state: int = ServiceState.RUNNING
    load: Load = field(default_factory=Load)
    alive: bool = True
    model_id: str = ""   # the identity it announced ("" = it serves no model)

    @property
    def accepts_work(self) -> bool:
        return self.alive and self.state == ServiceState.RUNNING


class MembershipTable:
    def __init__(self, dead_after_s: float):
        self.dead_after_s = dead_after_s
        self._peers: dict[str, Peer] = {}

    def register(self, instance: str, kind: str, address: str, role: str, now: float, model_id: str = "") -> Peer:
        """Add (or replace: a restart) a peer; ModelMismatch if a live peer of its kind serves another model."""
        pool = self.model_id(kind, besides=instance)
        if model_id and pool and model_id != pool:
            raise ModelMismatch(f"{instance} serves model {model_id!r} but the live {kind}s here serve {pool!r}: "
                                f"one pool serves one model (check the topology's [model] table)")
        peer = Peer(instance, kind, address, role, last_seen=now, model_id=model_id)
        self._peers[instance] = peer   # a restarted instance replaces its old entry
        return peer

    def model_id(self, kind: str | None = None, besides: str = "") -> str:
        """The model identity the live peers (of `kind`, other than `besides`) announced; "" if none did."""
        for peer in self._peers.values():
            if peer.alive and peer.model_id and peer.instance != besides and kind in (None, peer.kind):
                return peer.model_id
        return ""

    def heartbeat(self, instance: str, state: int, load: Load, now: float) -> bool:
        """Record a heartbeat; False if the instance is unknown or was declared dead (re-register)."""
        peer = self._peers.get(instance)
        if peer is None or not peer.alive:
            return False
        peer.last_seen, peer.state, peer.load = now, state, load
        return True

    def expire(self, now: float) -> list[Peer]:
        """Declare dead every live peer silent for longer than dead_after_s; return them."""
        dead = [p for p in self._peers.values() if p.alive and now - p.last_seen > self.dead_after_s]
        for peer in dead:
            peer.alive = False
        return dead

    def forget(self, instance: str) -> None:
        self._peers.pop(instance, None)

    def get(self, instance: str) -> Peer | None:
        return self._peers.get(instance)

    def alive(self, kind: str | None = None) -> list[Peer]:
        return [p for p in self._peers.values() if p.alive and (kind is None or p.kind == kind)]

    def status(self, now: float) -> list[PeerStatus]:
        return [PeerStatus(p.instance, p.kind, p.address, p.alive, round(now - p.last_seen, 3), p.load,
                           int(p.state), p.model_id)
                for p in self._peers.values()]


class DispatchTracker:
    """request id -> (peer instance now holding it, the caller to answer), so a peer's death
    fails exactly its work with a typed error instead of leaving callers waiting."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[str, object]] = {}

    def track(self, request_id: str, instance: str, caller: object) -> None:
        self._held[request_id] = (instance, caller)

    def untrack(self, request_id: str) -> None:
        self._held.pop(request_id, None)

    def holder(self, request_id: str) -> str | None:
        held = self._held.get(request_id)
        return held[0] if held else None

    def take_held_by(self, instance: str) -> list[tuple[str, object]]:
        """Remove and return (request id, caller) for everything `instance` held."""
        taken = [(rid, caller) for rid, (inst, caller) in self._held.items() if inst == instance]
        for rid, _ in taken:
            del self._held[rid]
        return taken

    def __len__(self) -> int:
        return len(self._held)
