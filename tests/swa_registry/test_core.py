"""SwaRegistry: TTL, several holders per hash, ownership, dead holders, capacity and input checks
(no sockets). Incarnations and silent holders: test_incarnations.py."""
from __future__ import annotations

import math

import pytest

from messages.errors import ErrorCode, InvalidRequest
from services.swa_registry.core import RegistryLimits, SwaRegistry


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def reg(clock) -> SwaRegistry:
    return SwaRegistry(clock=clock)


def test_registered_hashes_are_found_and_unknown_ones_miss(reg):
    assert reg.register([h(1), h(2)], "tcp://w1:5000", 180.0) == 2
    assert reg.lookup([h(1), h(3), h(2)]) == ["tcp://w1:5000", "", "tcp://w1:5000"]
    assert (reg.stats.lookups, reg.stats.hits, reg.stats.misses) == (3, 2, 1)


def test_entry_is_a_miss_once_its_ttl_has_passed(reg, clock):
    reg.register([h(1)], "w1", 180.0)
    clock.now += 179.9
    assert reg.lookup([h(1)]) == ["w1"]
    clock.now += 0.1
    assert reg.lookup([h(1)]) == [""]


def test_explicit_now_overrides_the_clock():
    reg = SwaRegistry(clock=lambda: pytest.fail("clock must not be read"))
    reg.register([h(1)], "w1", 10.0, now=0.0)
    assert reg.lookup([h(1)], now=9.0) == ["w1"]
    assert reg.lookup([h(1)], now=10.0) == [""]
    assert reg.expire(now=10.0) == 1


def test_default_ttl_is_180_seconds(reg, clock):
    reg.register([h(1)], "w1")
    clock.now += 179.0
    assert reg.lookup([h(1)]) == ["w1"]
    clock.now += 1.0
    assert reg.lookup([h(1)]) == [""]


def test_expire_removes_only_expired_entries_and_counts_them(reg, clock):
    reg.register([h(1), h(2)], "w1", 10.0)
    reg.register([h(3)], "w2", 30.0)
    clock.now += 5.0
    assert reg.expire() == 0
    clock.now += 5.0
    assert reg.expire() == 2
    assert len(reg) == 1 and reg.stats.expirations == 2
    assert reg.lookup([h(3)]) == ["w2"]
    clock.now += 20.0
    assert reg.expire() == 1 and len(reg) == 0 and reg.holders() == 0


def test_expire_respects_its_limit(reg, clock):
    reg.register([h(i) for i in range(10)], "w1", 1.0)
    clock.now += 1.0
    assert reg.expire(limit=4) == 4
    assert reg.expire(limit=4) == 4
    assert reg.expire(limit=4) == 2
    assert len(reg) == 0


def test_reregistering_restarts_the_ttl_and_expire_keeps_the_fresh_entry(reg, clock):
    reg.register([h(1)], "w1", 10.0)
    clock.now += 8.0
    reg.register([h(1)], "w1", 10.0)
    clock.now += 5.0       # past the first expiry, before the second
    assert reg.expire() == 0
    assert reg.lookup([h(1)]) == ["w1"]


def test_another_holder_is_found_first_and_the_earlier_one_stays_behind_it(reg, clock):
    reg.register([h(1)], "w1", 10.0)
    clock.now += 8.0
    reg.register([h(1)], "w2", 10.0)
    assert reg.lookup([h(1)]) == ["w2"] and len(reg) == 2
    assert reg.drop_holder("w2") == 1          # the latest holder died: the earlier one still has it
    assert reg.lookup([h(1)]) == ["w1"]
    clock.now += 5.0                           # w1's own TTL ran out
    assert reg.lookup([h(1)]) == [""]


def test_a_hash_keeps_its_latest_holders_only(clock):
    reg = SwaRegistry(RegistryLimits(max_holders_per_hash=2), clock=clock)
    for holder in ("w1", "w2", "w3"):
        reg.register([h(1)], holder, 10.0)
    assert len(reg) == 2 and reg.stats.evictions == 1
    assert reg.drop_holder("w1") == 0          # the oldest registration made room
    reg.register([h(1)], "w2", 10.0)           # registering again makes it the latest
    assert reg.lookup([h(1)]) == ["w2"] and reg.drop_holder("w2") == 1 and reg.lookup([h(1)]) == ["w3"]


def test_unregister_by_the_owner_removes_the_entry(reg):
    reg.register([h(1), h(2)], "w1", 10.0)
    assert reg.unregister([h(1), h(9)], "w1") == 1
    assert reg.lookup([h(1), h(2)]) == ["", "w1"]


def test_unregister_removes_only_that_holders_entry(reg):
    reg.register([h(1)], "w1", 10.0)
    reg.register([h(1)], "w2", 10.0)
    assert reg.unregister([h(1)], "w3") == 0
    assert reg.unregister([h(1)], "w2") == 1
    assert reg.lookup([h(1)]) == ["w1"]


def test_drop_holder_removes_all_of_a_dead_workers_entries(reg):
    reg.register([h(1), h(2), h(3)], "w1", 10.0)
    reg.register([h(4)], "w2", 10.0)
    assert reg.drop_holder("w1") == 3
    assert reg.lookup([h(1), h(2), h(3), h(4)]) == ["", "", "", "w2"]
    assert reg.drop_holder("w1") == 0 and reg.holders() == 1


def test_a_full_registry_evicts_the_entries_closest_to_expiry(clock):
    reg = SwaRegistry(RegistryLimits(max_entries=3), clock=clock)
    reg.register([h(1)], "w1", 50.0)
    reg.register([h(2)], "w1", 10.0)     # closest to expiry
    reg.register([h(3)], "w1", 30.0)     # next closest
    reg.register([h(4), h(5)], "w2", 100.0)
    assert len(reg) == 3 and reg.stats.evictions == 2
    assert reg.lookup([h(1), h(2), h(3), h(4), h(5)]) == ["w1", "", "", "w2", "w2"]


def test_a_full_registry_drops_expired_entries_before_evicting_live_ones(clock):
    reg = SwaRegistry(RegistryLimits(max_entries=2), clock=clock)
    reg.register([h(1)], "w1", 5.0)
    reg.register([h(2)], "w1", 50.0)
    clock.now += 10.0
    reg.register([h(3)], "w2", 50.0)
    assert reg.stats.evictions == 0 and reg.stats.expirations == 1
    assert reg.lookup([h(2), h(3)]) == ["w1", "w2"]


def test_registering_again_in_a_full_registry_evicts_nothing(clock):
    reg = SwaRegistry(RegistryLimits(max_entries=2), clock=clock)
    reg.register([h(1), h(2)], "w1", 10.0)
    reg.register([h(1)], "w1", 20.0)
    assert reg.stats.evictions == 0 and reg.lookup([h(1), h(2)]) == ["w1", "w1"]
    reg.register([h(1)], "w2", 10.0)         # a new (hash, holder) pair: the one closest to expiry goes
    assert reg.stats.evictions == 1 and reg.lookup([h(1), h(2)]) == ["w2", ""]


def test_ttl_above_the_maximum_is_clamped(clock):
    reg = SwaRegistry(RegistryLimits(max_ttl_s=600.0), clock=clock)
    reg.register([h(1)], "w1", 1e9)
    clock.now += 599.0
    assert reg.lookup([h(1)]) == ["w1"]
    clock.now += 1.0
    assert reg.lookup([h(1)]) == [""]


@pytest.mark.parametrize("ttl", [0.0, -1.0, math.inf, -math.inf, math.nan])
def test_non_positive_or_non_finite_ttl_is_rejected(reg, ttl):
    with pytest.raises(InvalidRequest) as err:
        reg.register([h(1)], "w1", ttl)
    assert err.value.code == ErrorCode.INVALID_REQUEST
    assert len(reg) == 0


@pytest.mark.parametrize("bad", [b"", bytes(65), "not-bytes", 7, None])
def test_hashes_must_be_1_to_64_bytes(reg, bad):
    for call in (lambda: reg.register([h(1), bad], "w1", 10.0),
                 lambda: reg.lookup([bad]),
                 lambda: reg.unregister([bad], "w1")):
        with pytest.raises(InvalidRequest):
            call()
    assert len(reg) == 0      # a rejected batch changes nothing, not even its valid hashes


def test_hash_lengths_at_the_bounds_are_accepted(reg):
    assert reg.register([bytes(1), b"\x01" * 64], "w1", 10.0) == 2


def test_too_many_hashes_in_one_message_are_rejected(clock):
    reg = SwaRegistry(RegistryLimits(max_hashes_per_message=4), clock=clock)
    assert reg.register([h(i) for i in range(4)], "w1", 10.0) == 4
    with pytest.raises(InvalidRequest):
        reg.register([h(i) for i in range(5)], "w1", 10.0)
    with pytest.raises(InvalidRequest):
        reg.lookup([h(i) for i in range(5)])
    with pytest.raises(InvalidRequest):
        reg.unregister([h(i) for i in range(5)], "w1")


@pytest.mark.parametrize("holder", ["", "x" * 257, None])
def test_holder_must_be_a_non_empty_bounded_string(reg, holder):
    with pytest.raises(InvalidRequest):
        reg.register([h(1)], holder, 10.0)


def test_invalid_limits_are_refused():
    for bad in ({"max_ttl_s": 0}, {"max_ttl_s": math.inf}, {"default_ttl_s": 700.0},
                {"max_entries": 0}, {"max_hashes_per_message": 0}, {"max_holders_per_hash": 0},
                {"max_holders": 0}):
        with pytest.raises(ValueError):
            RegistryLimits(**bad)


def test_stale_heap_items_are_compacted_under_churn(reg, clock):
    for _ in range(3000):
        reg.register([h(1), h(2)], "w1", 10.0)
        clock.now += 0.001
    assert len(reg) == 2
    assert len(reg._heap) <= 2 * len(reg) + 1024 + 2
    clock.now += 10.0
    assert reg.expire() == 2 and len(reg) == 0
