"""DecodeSlots: the prefill router's choice of decode worker from the decode router's table. A
reservation counts on its worker until a heartbeat sent after its hand-off is in the table, or
until it is released; a stale table, or no worker with room, gives None (the request waits)."""
from __future__ import annotations

import msgspec
import pytest

from messages.control import Load, PeerStatus, ServiceState
from messages.routing import DecodeTable
from services.decode_router.core import DecodePolicy
from services.prefill_router.decode_slots import DecodeSlots


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def peer(name: str, batch: int = 0, kv: float = 0.0, capacity: int = 0, age: float = 0.0,
         state: int = ServiceState.RUNNING, alive: bool = True) -> PeerStatus:
    return PeerStatus(name, "decode_worker", f"tcp://{name}:1", alive, age,
                      Load(batch_size=batch, kv_usage=kv, capacity=capacity), int(state))


def table(*workers: PeerStatus, alpha: float = 1.0, beta: float = 1.0) -> DecodeTable:
    return DecodeTable(list(workers), alpha, beta)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def slots(clock) -> DecodeSlots:
    return DecodeSlots(stale_after_s=3.0, clock=clock)


def test_reservations_spread_a_burst_over_equal_workers(slots):
    slots.update(table(peer("a"), peer("b")))
    picks = [slots.reserve(f"r{i}") for i in range(4)]
    assert [(r.instance, r.address) for r in picks] == [("a", "tcp://a:1"), ("b", "tcp://b:1")] * 2
    assert slots.pending() == {"a": 2, "b": 2} and slots.held() == 4


def test_reserving_the_same_request_twice_keeps_one_reservation(slots):
    slots.update(table(peer("a"), peer("b")))
    first = slots.reserve("r1")
    assert slots.reserve("r1") is first
    assert slots.pending() == {first.instance: 1}


def test_the_reported_load_decides_and_pending_adds_to_it(slots):
    slots.update(table(peer("busy", batch=3), peer("idle", batch=0)))
    assert [slots.reserve(f"r{i}").instance for i in range(4)] == ["idle", "idle", "idle", "busy"]
    # idle reaches 3 estimated, as many as busy: ties go to the smaller batch, then the name


def test_a_reservation_counts_until_a_heartbeat_newer_than_its_hand_off(slots, clock):
    slots.update(table(peer("a"), peer("b", kv=0.1)))
    assert slots.reserve("r1").instance == "a"
    clock.now = 101.0
    slots.update(table(peer("a"), peer("b", kv=0.1)))          # a fresh heartbeat, but no hand-off yet
    assert slots.pending() == {"a": 1}
    clock.now = 102.0
    slots.handed_off("r1")                                     # PrefillDone at 102
    clock.now = 103.0
    slots.update(table(peer("a", age=1.5), peer("b", kv=0.1)))   # heartbeat at 101.5: cannot show it yet
    assert slots.pending() == {"a": 1}
    assert slots.reserve("r2").instance == "b"                 # a still counts r1
    slots.release("r2")
    clock.now = 104.0
    slots.update(table(peer("a", batch=1, age=1.5), peer("b", kv=0.1)))   # heartbeat at 102.5: includes r1
    assert slots.pending() == {} and slots.held() == 0


def test_a_second_hand_off_signal_does_not_move_the_hand_off_later(slots, clock):
    slots.update(table(peer("a")))
    slots.reserve("r1")
    slots.handed_off("r1")                                     # at 100
    clock.now = 105.0
    slots.handed_off("r1")
    slots.update(table(peer("a", age=4.0)))                    # heartbeat at 101, after the first
    assert slots.held() == 0


def test_release_frees_the_slot_at_once(slots):
    slots.update(table(peer("a", capacity=1)))
    assert slots.reserve("r1").instance == "a"
    assert slots.reserve("r2") is None                         # a is full with r1 pending
    slots.release("r1")
    assert slots.pending() == {} and slots.reserve("r2").instance == "a"
    slots.release("never-reserved")                            # harmless
    assert slots.held() == 1


def test_a_handed_off_reservation_of_a_worker_that_left_the_table_is_dropped(slots, clock):
    slots.update(table(peer("a"), peer("b")))
    slots.reserve("r1")                                        # a
    slots.reserve("r2")                                        # b
    slots.reserve("r3")                                        # a
    slots.handed_off("r1")
    clock.now = 101.0
    slots.update(table(peer("b", age=5.0)))                    # a died: its heartbeats will never show r1
    assert slots.pending() == {"a": 1, "b": 1}                 # r3 was not handed off: still held
    slots.release("r3")
    assert slots.held() == 1 and slots.reserve("r4").instance == "b"


def test_a_stale_table_reserves_nothing(slots, clock):
    assert not slots.fresh() and slots.reserve("r0") is None   # no table yet
    slots.update(table(peer("a")))
    clock.now = 103.0
    assert slots.fresh() and slots.reserve("r1").instance == "a"
    clock.now = 103.5
    assert not slots.fresh() and slots.reserve("r2") is None
    assert slots.reserve("r1").instance == "a"                 # what is already reserved stays
    slots.update(table(peer("a")))
    assert slots.reserve("r2").instance == "a"


def test_no_worker_with_room_reserves_nothing(slots):
    slots.update(table())
    assert slots.reserve("r0") is None
    slots.update(table(peer("full", batch=4, capacity=4), peer("draining", state=ServiceState.DRAINING),
                       peer("dead", alive=False)))
    assert slots.reserve("r1") is None and slots.held() == 0
    slots.update(table(peer("a", batch=1, capacity=3)))
    assert [slots.reserve(f"r{i}") is not None for i in range(3)] == [True, True, False]


def test_only_running_alive_workers_are_chosen(slots):
    slots.update(table(peer("draining", state=ServiceState.DRAINING), peer("dead", alive=False),
                       peer("running", kv=0.99, batch=50)))
    assert slots.reserve("r1").instance == "running"


def test_the_policy_comes_from_the_table(slots):
    workers = (peer("long-ctx", kv=0.8, batch=4), peer("many-short", kv=0.3, batch=64))
    slots.update(table(*workers, alpha=1.0, beta=0.0))
    assert slots.policy == DecodePolicy(1.0, 0.0)
    assert slots.reserve("r1").instance == "many-short"
    slots.release("r1")
    slots.update(table(*workers, alpha=0.0, beta=1.0))
    assert slots.policy == DecodePolicy(0.0, 1.0)
    assert slots.reserve("r1").instance == "long-ctx"


def test_workers_counts_the_table(slots):
    assert slots.workers() == 0
    slots.update(table(peer("a"), peer("b", state=ServiceState.DRAINING)))
    assert slots.workers() == 2


def test_a_worker_a_hand_off_found_dead_is_skipped_until_it_heartbeats_again(slots, clock):
    slots.update(table(peer("a"), peer("b", kv=0.5)))
    assert slots.reserve("r1").instance == "a"
    slots.release("r1")
    clock.now = 101.0
    slots.suspect("a")                                         # PEER_DEAD from the hand-off at 101
    slots.update(table(peer("a", age=0.5), peer("b", kv=0.5)))   # its last heartbeat (100.5) predates it
    assert slots.reserve("r2").instance == "b"
    slots.release("r2")
    clock.now = 102.0
    slots.update(table(peer("a", age=0.5), peer("b", kv=0.5)))   # heartbeat at 101.5: alive again (restarted)
    assert slots.reserve("r3").instance == "a"


def test_when_every_worker_is_suspect_nothing_is_reserved(slots, clock):
    slots.update(table(peer("a")))
    slots.suspect("a")
    assert slots.reserve("r1") is None                         # the request waits in the queue instead


def test_a_worker_the_gateway_saw_die_is_skipped_by_its_address(slots, clock):
    """A resumed request names the decode worker that died under it (GenerateRequest.avoid_workers):
    the decode router may list it as alive for seconds yet, so it is suspect until it heartbeats."""
    slots.update(table(peer("a"), peer("b", kv=0.5)))
    clock.now = 101.0
    slots.suspect_address(peer("a").address)
    slots.update(table(peer("a", age=0.5), peer("b", kv=0.5)))
    assert slots.reserve("r1").instance == "b"
    slots.suspect_address("tcp://nowhere:1")   # not in the table: nothing to skip
    slots.release("r1")
    assert slots.reserve("r2").instance == "b"


def test_decode_workers_of_another_model_than_the_prefill_pool_are_no_candidates(slots):
    plain, released = "tiny-float32-01", "tiny-float32+released-01"
    workers = [msgspec.structs.replace(peer("a", batch=0), model_id=released),   # the least loaded, but
               msgspec.structs.replace(peer("b", batch=3), model_id=plain)]      # only b serves the pool's model
    slots.update(table(*workers), model_id=plain)
    assert slots.mismatched == ["a"] and slots.workers() == 1
    assert slots.reserve("r1").instance == "b"
    slots.update(table(*workers))   # the prefill pool's identity not known yet: nothing to compare with
    assert slots.mismatched == [] and slots.workers() == 2
