"""PendingCalls: the request/reply calls a service is waiting on, and their timeouts.

A call registers a future under its message id; the reply (any inbound message whose header says
`in_reply_to` that id) settles it. One timer serves every deadline: it fires at the earliest one,
times out whatever is past due and re-arms for the next, instead of a call_later per call.
"""
from __future__ import annotations

import asyncio

from messages.errors import PeerDead


class PendingCalls:
    def __init__(self) -> None:
        self._pending: dict[str, tuple[asyncio.Future, str, float]] = {}   # msg id -> (future, address, deadline)
        self._sweep: asyncio.TimerHandle | None = None
        self._sweep_at = 0.0
        self.closed = False

    def __len__(self) -> int:
        return len(self._pending)

    def open(self, msg_id: str, address: str, timeout_s: float) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        deadline = loop.time() + timeout_s
        self._pending[msg_id] = (future, address, deadline)
        if self._sweep is None or deadline < self._sweep_at:
            self._arm(loop, deadline)
        return future

    def forget(self, msg_id: str) -> None:
        self._pending.pop(msg_id, None)

    def settle(self, msg_id: str, envelope) -> bool:
        """Deliver a reply; False when no call waits for `msg_id` (then it is not a reply of ours)."""
        pending = self._pending.get(msg_id)
        if pending is None:
            return False
        if not pending[0].done():
            pending[0].set_result(envelope)
        return True

    def fail_to(self, address: str) -> None:
        """Calls to a peer that is gone will never be answered: fail them now."""
        for future, target, _ in list(self._pending.values()):
            if target == address and not future.done():
                future.set_exception(PeerDead(f"{address} is gone"))

    def close(self) -> None:
        self.closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
        self._sweep_at = when
        self._sweep = loop.call_at(when, self._expire)

    def _expire(self) -> None:
        """The timer of the earliest deadline: time out every call past its deadline, re-arm for the next."""
        self._sweep = None
        loop = asyncio.get_running_loop()
        now, earliest = loop.time(), None
        for future, _, deadline in list(self._pending.values()):
            if future.done():
                continue
            if deadline <= now:
                future.set_exception(asyncio.TimeoutError())
            elif earliest is None or deadline < earliest:
                earliest = deadline
        if earliest is not None and not self.closed:
            self._arm(loop, earliest)
