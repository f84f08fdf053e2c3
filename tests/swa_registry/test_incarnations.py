"""SwaRegistry and processes (no sockets): a new incarnation at an address retires everything its
predecessor registered, late messages of a retired process change nothing, check-ins say whether the
registry knew the process, silent holders lose their entries (but not for the registry's own stall),
and a fetch is never routed to the requester or to a dead process's entries."""
from __future__ import annotations

import pytest

from messages.errors import InvalidRequest
from services.swa_registry.core import RegistryLimits, SwaRegistry
from services.swa_registry.holders import CheckIn

A, B = "tcp://worker-a:6000", "tcp://worker-b:6000"
OLD, NEW = "a1a1a1a1a1a1a1a1", "b2b2b2b2b2b2b2b2"


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def reg(clock) -> SwaRegistry:
    return SwaRegistry(clock=clock, holder_timeout_s=3.0)


def test_a_new_incarnation_at_an_address_drops_what_the_old_one_registered(reg):
    reg.register([h(1), h(2)], B, 60.0, incarnation="b")
    reg.register([h(1), h(2), h(3)], A, 60.0, incarnation=OLD)      # A registered last: found first
    assert reg.lookup([h(1), h(2), h(3)]) == [A, A, A]
    assert reg.check_in(A, NEW) is CheckIn.REPLACED                    # A restarted at the same address
    assert reg.lookup([h(1), h(2), h(3)]) == [B, B, ""]               # at once, not at the TTL
    assert (reg.stats.restarts, reg.stats.dropped) == (1, 3)
    reg.register([h(3)], A, 60.0, incarnation=NEW)                     # what the new process holds itself
    assert reg.lookup([h(3)]) == [A]


def test_a_late_registration_of_the_retired_process_changes_nothing(reg):
    reg.register([h(1)], A, 60.0, incarnation=OLD)
    reg.register([h(2)], A, 60.0, incarnation=NEW)
    assert reg.register([h(1), h(3)], A, 60.0, incarnation=OLD) == 0   # in flight when it died
    assert reg.lookup([h(1), h(2), h(3)]) == ["", A, ""]
    assert reg.check_in(A, OLD) is CheckIn.STALE and reg.lookup([h(2)]) == [A]


def test_the_restart_that_lost_the_hit_a_restarted_requester_gets_another_processes_window(reg):
    """Seen on a stack: the registry named the dead process at the restarted worker's address, so
    the worker's own fetch skipped it as "the requester's" and the window that B held was hidden."""
    reg.register([h(1), h(2)], B, 60.0, incarnation="b")
    reg.register([h(1), h(2)], A, 60.0, incarnation=OLD)
    assert reg.choose([h(2), h(1)], requester=A) == (B, [h(2), h(1)])     # never the requester itself
    reg.check_in(A, NEW)          # the restarted A's fetch names its incarnation
    assert reg.choose([h(2), h(1)], requester=A) == (B, [h(2), h(1)])
    assert reg.choose([h(2), h(1)], requester="tcp://worker-c:6000") == (B, [h(2), h(1)])   # not the dead A


def test_a_fetch_goes_to_the_latest_holder_of_the_first_hash_that_has_one(reg):
    reg.register([h(2)], B, 60.0)
    reg.register([h(3), h(2)], A, 60.0)
    assert reg.choose([h(1), h(2), h(3)], requester="c") == (A, [h(2), h(3)])
    assert reg.choose([h(1), h(2)], requester=A) == (B, [h(2)])
    assert reg.choose([h(1)], requester="c") == ("", [])


def test_check_in_says_whether_the_registry_already_had_the_process(reg):
    assert reg.check_in(A, OLD, answered=True) is CheckIn.UNKNOWN     # first time: register what you hold
    assert reg.check_in(A, OLD, answered=True) is CheckIn.KNOWN
    # a one-way registration reaches a registry that never heard of B (it restarted): the next
    # answered check-in still says unknown, so B registers everything it holds, then known
    reg.register([h(1)], B, 60.0, incarnation="b")
    assert reg.check_in(B, "b", answered=True) is CheckIn.UNKNOWN
    assert reg.check_in(B, "b", answered=True) is CheckIn.KNOWN


def test_a_silent_holder_loses_its_entries_and_is_unknown_when_it_returns(reg, clock):
    reg.register([h(1)], A, 60.0, incarnation=OLD)
    reg.register([h(1)], B, 60.0, incarnation="b")
    reg.register([h(2)], "tcp://tool:1", 60.0)      # no incarnation: not tracked, never judged silent
    for _ in range(4):                               # B checks in every second, A stays silent
        clock.now += 1.0
        reg.check_in(B, "b", answered=True)
        assert reg.expire_holders() == ([A] if _ == 3 else [])
    assert reg.lookup([h(1), h(2)]) == [B, "tcp://tool:1"]
    assert reg.check_in(A, OLD, answered=True) is CheckIn.UNKNOWN     # back (it was frozen): re-register


def test_the_registrys_own_stall_is_not_counted_as_the_holders_silence(reg, clock):
    reg.register([h(1)], A, 60.0, incarnation=OLD)
    assert reg.expire_holders() == []
    clock.now += 10.0           # this process was paused: nobody could be heard
    assert reg.expire_holders() == [] and reg.lookup([h(1)]) == [A]
    clock.now += 1.0            # from here on A's silence counts
    assert reg.expire_holders() == [] and reg.lookup([h(1)]) == [A]
    clock.now += 1.0
    assert reg.expire_holders() == [A] and reg.lookup([h(1)]) == [""]


def test_drop_holder_forgets_the_process_too(reg):
    reg.register([h(1)], A, 60.0, incarnation=OLD)
    assert reg.drop_holder(A) == 1
    assert reg.check_in(A, OLD, answered=True) is CheckIn.UNKNOWN


@pytest.mark.parametrize("incarnation", ["x" * 65, 7])
def test_a_bad_incarnation_is_refused_before_anything_changes(reg, incarnation):
    reg.register([h(1)], A, 60.0, incarnation=OLD)
    with pytest.raises(InvalidRequest):
        reg.register([h(2)], A, 60.0, incarnation=incarnation)
    assert reg.lookup([h(1), h(2)]) == [A, ""]


def test_the_number_of_tracked_processes_is_bounded(clock):
    reg = SwaRegistry(RegistryLimits(max_holders=2), clock=clock)
    reg.check_in(A, OLD)
    reg.check_in(B, "b")
    reg.check_in(A, NEW)                      # a known address may change process
    with pytest.raises(InvalidRequest):
        reg.register([h(1)], "tcp://c:1", 60.0, incarnation="c")
    assert len(reg) == 0
    assert reg.register([h(1)], "tcp://c:1", 60.0) == 1     # untracked registrations still work
