"""DecodeSlots: the decode worker for each request, chosen here from the decode router's load table.

The decode router publishes DecodeTable (each live decode worker's last heartbeat load and that
heartbeat's age); the prefill router refreshes it in the background, so choosing costs no round
trip. A choice is a reservation: it counts toward its worker's batch (`pending` in DeepSeek's
score, services/decode_router/core.py) from the moment it is made until the worker's own reports
can show it, that is until a heartbeat sent after the hand-off completed (PrefillDone) is in the
table. A request that fails or is aborted before its hand-off releases its slot at once.

A worker that a hand-off found dead (the prefill worker answered PEER_DEAD) is skipped until the
table shows a heartbeat it sent after that: the decode router needs up to dead_after_s to drop it,
and a resumed request must not be sent to the same dead worker again meanwhile.

A decode worker whose model identity differs from the prefill pool's (`model_id`, from the prefill
workers' registrations) is no candidate: a hand-off between two models would be refused, and its
blocks' hashes would mean another model. `mismatched` names them, for the shell to log.

No worker with room (all at capacity, none alive, or no table for `stale_after_s`: the decode
router is gone, so its view may hold dead workers): `reserve` returns None and the request waits
in the prefill router's queue, bounded and with a deadline, instead of being refused.
Pure and synchronous, clock injected.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from messages.control import ServiceState
from messages.routing import DecodeTable
from services.decode_router.core import DecodeCandidate, DecodePolicy, rank


@dataclass(slots=True)
class Reservation:
    instance: str
    address: str
    handed_off_at: float | None = None   # when PrefillDone came back (this clock)


class DecodeSlots:
    def __init__(self, stale_after_s: float = 3.0, clock: Callable[[], float] = time.monotonic):
        self.stale_after_s = stale_after_s
        self.clock = clock
        self.policy = DecodePolicy()
        self._candidates: list[DecodeCandidate] = []
        self._reported_at: dict[str, float] = {}    # instance -> when its reported load was measured
        self._table_at: float | None = None
        self._held: dict[str, Reservation] = {}      # request id -> its reservation
        self._suspect: dict[str, float] = {}         # instance -> when a hand-off found it dead
        self.mismatched: list[str] = []              # decode workers serving another model than model_id

    def update(self, table: DecodeTable, now: float | None = None, model_id: str = "") -> None:
        """A fresh table: the workers' loads, and which reservations their reports now include.
        `model_id`: the prefill pool's identity ("" = not known yet: every worker is a candidate)."""
        now = self.clock() if now is None else now
        self.policy = DecodePolicy(table.alpha, table.beta)
        self.mismatched = [w.instance for w in table.workers if model_id and w.model_id and w.model_id != model_id]
        self._candidates = [DecodeCandidate(w.instance, w.address, w.load,
                                            w.alive and w.state == ServiceState.RUNNING) for w in table.workers
                            if w.instance not in self.mismatched]
        self._reported_at = {w.instance: now - w.last_heartbeat_age_s for w in table.workers}
        self._table_at = now
        for rid in [rid for rid, r in self._held.items() if self._visible(r)]:
            del self._held[rid]
        for instance in [i for i, at in self._suspect.items() if self._reported_at.get(i, at) > at]:
            del self._suspect[instance]   # it heartbeat since (a restarted process, a short stall)

    def _visible(self, r: Reservation) -> bool:
        """Handed off and either in its worker's reported load, or its worker left the table (died)."""
        if r.handed_off_at is None:
            return False
        reported = self._reported_at.get(r.instance)
        return reported is None or reported >= r.handed_off_at

    def pending(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self._held.values():
            counts[r.instance] = counts.get(r.instance, 0) + 1
        return counts

    def fresh(self, now: float | None = None) -> bool:
        now = self.clock() if now is None else now
        return self._table_at is not None and now - self._table_at <= self.stale_after_s

    def reserve(self, request_id: str, now: float | None = None) -> Reservation | None:
        """The best decode worker with room for one more request, counted on it; None if none."""
        if request_id in self._held:
            return self._held[request_id]
        if not self.fresh(now):
            return None
        candidates = [c for c in self._candidates if c.instance not in self._suspect] if self._suspect \
            else self._candidates
        ranked = rank(candidates, self.pending(), self.policy)
        if not ranked:
            return None
        best = ranked[0].candidate
        held = self._held[request_id] = Reservation(best.instance, best.address)
        return held

    def handed_off(self, request_id: str, now: float | None = None) -> None:
        """The state reached the decode worker: count it until the worker's reports include it."""
        held = self._held.get(request_id)
        if held is not None and held.handed_off_at is None:
            held.handed_off_at = self.clock() if now is None else now

    def suspect(self, instance: str, now: float | None = None) -> None:
        """A hand-off to `instance` found it dead: choose others until it heartbeats again."""
        self._suspect[instance] = self.clock() if now is None else now

    def suspect_address(self, address: str, now: float | None = None) -> None:
        """The worker at `address` died under a request (the gateway saw it): as `suspect`."""
        for candidate in self._candidates:
            if candidate.address == address:
                self.suspect(candidate.instance, now)

    def release(self, request_id: str) -> None:
        """The request will not reach its decode worker (failed, aborted): free its slot now."""
        self._held.pop(request_id, None)

    def held(self) -> int:
        return len(self._held)

    def workers(self) -> int:
        return len(self._candidates)
