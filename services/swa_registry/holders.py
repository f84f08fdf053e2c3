"""HolderTable: which process (incarnation) serves at each holder address, and when it was last heard.

A worker restarted at its old address is a new process that holds none of its predecessor's window
states, so an address alone cannot name a holder. Every message a worker sends the registry with
its incarnation "checks it in" here:
  - the first incarnation heard at an address is recorded;
  - a different one retires the recorded one (the caller drops everything it registered); the
    retired ids are remembered, so a late message of the dead process cannot bring it back;
  - a holder silent for longer than `timeout_s` is forgotten by `expire` (its entries dropped).
    Time this registry itself did not run (a stalled or paused process: nobody could be heard)
    does not count as the holders' silence.
`known` tells a worker whether the registry already held its registrations before this check-in:
False for a new process, after a registry restart or after the worker was forgotten as silent;
the worker then registers every window state it holds again. Addresses that never named an
incarnation (tools, older workers) are not tracked: always live, never replaced.
Pure and synchronous; times are passed in.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

RETIRED_KEPT = 4      # earlier incarnations remembered per address (late messages of dead processes)


class CheckIn(Enum):
    KNOWN = "known"         # the process this address already had, in sync with the registry
    UNKNOWN = "unknown"     # new here (or its registrations were lost): it must register all it holds
    REPLACED = "replaced"   # a new process at an address that had another: drop the old one's entries
    STALE = "stale"         # a retired process: ignore its message


@dataclass(slots=True)
class Holder:
    incarnation: str
    last_seen: float
    in_sync: bool                        # told `known=False` since it was recorded, so it re-registered
    retired: list[str] = field(default_factory=list)


class HolderTable:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._holders: dict[str, Holder] = {}
        self._expired_at: float | None = None   # the last `expire`, to notice this registry's own stalls

    def __len__(self) -> int:
        return len(self._holders)

    def check_in(self, address: str, incarnation: str, now: float, answered: bool) -> CheckIn:
        """A message from process `incarnation` at `address`; `answered`: the sender gets `known`
        back (an acknowledged registration), so from now on its registrations are complete."""
        holder = self._holders.get(address)
        if holder is None:
            self._holders[address] = Holder(incarnation, now, in_sync=answered)
            return CheckIn.UNKNOWN
        if holder.incarnation == incarnation:
            holder.last_seen = now
            was_in_sync, holder.in_sync = holder.in_sync, holder.in_sync or answered
            return CheckIn.KNOWN if was_in_sync else CheckIn.UNKNOWN
        if incarnation in holder.retired:
            return CheckIn.STALE
        retired = [*holder.retired, holder.incarnation][-RETIRED_KEPT:]
        self._holders[address] = Holder(incarnation, now, in_sync=answered, retired=retired)
        return CheckIn.REPLACED

    def incarnation(self, address: str) -> str:
        holder = self._holders.get(address)
        return holder.incarnation if holder is not None else ""

    def forget(self, address: str) -> None:
        self._holders.pop(address, None)

    def expire(self, now: float) -> list[str]:
        """Forget every holder silent for longer than `timeout_s`; their addresses. Called every
        fraction of the timeout: a longer gap since the last call means this registry stalled, so
        every holder gets half a timeout from now to be heard before it is judged."""
        stalled = self._expired_at is not None and now - self._expired_at > self.timeout_s / 2
        self._expired_at = now
        if stalled:
            for holder in self._holders.values():
                holder.last_seen = max(holder.last_seen, now - self.timeout_s / 2)
            return []
        silent = [a for a, h in self._holders.items() if now - h.last_seen > self.timeout_s]
        for address in silent:
            del self._holders[address]
        return silent
