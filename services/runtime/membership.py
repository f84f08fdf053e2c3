"""Who is registered with this service, who is still alive, and which work each peer holds.

Pure and clock-injected: the shell calls `expire(now)` periodically and acts on the result.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from messages.control import Load, PeerStatus, ServiceState


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

    @property
    def accepts_work(self) -> bool:
        return self.alive and self.state == ServiceState.RUNNING


class MembershipTable:
    def __init__(self, dead_after_s: float):
        self.dead_after_s = dead_after_s
        self._peers: dict[str, Peer] = {}

    def register(self, instance: str, kind: str, address: str, role: str, now: float) -> Peer:
        peer = Peer(instance, kind, address, role, last_seen=now)
        self._peers[instance] = peer   # a restarted instance replaces its old entry
        return peer

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
                           int(p.state))
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
