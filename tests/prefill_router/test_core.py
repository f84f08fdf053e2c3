"""PrefillRouterCore: buckets, re-balancing by quota share across rounds, pull under headroom,
least-loaded group and rank, bounds, failures."""
from __future__ import annotations

import pytest

from messages.control import Load
from messages.errors import ErrorCode, InvalidRequest, Overloaded
from services.prefill_router.core import PrefillRouterCore, RankView, RouterPolicy

SHORT, MEDIUM, LONG, HUGE = 1000, 10_000, 40_000, 100_000    # one prompt length per default bucket


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def rank(instance: str, group: str = "", tokens: int = 0, in_flight: int = 0, capacity: int = 0,
         accepts_work: bool = True, seen_at: float = 0.0) -> RankView:
    return RankView(instance, f"tcp://{instance}:1", group or instance,
                    Load(in_flight=in_flight, queued_tokens=tokens, capacity=capacity), accepts_work, seen_at)


@pytest.fixture
def clock() -> Clock:
    return Clock()


def make(clock: Clock, *ranks: RankView, **policy) -> PrefillRouterCore:
    core = PrefillRouterCore(RouterPolicy(**policy), clock=clock)
    core.update_ranks(ranks)
    return core


def submit(core: PrefillRouterCore, rid: str, tokens: int, hit: int = 0):
    return core.submit(rid, tokens, hit, payload=f"job-{rid}")


def test_requests_land_in_the_bucket_of_their_total_length(clock):
    core = make(clock)
    buckets = [submit(core, f"r{i}", n).bucket for i, n in enumerate((1, 4096, 4097, 16384, 16385, 65536, 65537))]
    assert buckets == [0, 0, 1, 1, 2, 2, 3]
    assert core.queue_lengths() == [2, 2, 2, 1]


def test_the_hit_does_not_change_the_bucket_only_the_quota():
    core = PrefillRouterCore(RouterPolicy())
    cold, warm = submit(core, "a", LONG), submit(core, "b", LONG, hit=LONG - 512)
    assert cold.bucket == warm.bucket == 2
    assert warm.quota < cold.quota / 10


def test_the_least_loaded_rank_inside_a_group_takes_the_request(clock):
    core = make(clock, rank("w0", "g", tokens=900), rank("w1", "g", tokens=100), rank("w2", "g", tokens=500))
    submit(core, "r1", SHORT)
    [held] = core.pump()
    assert (held.instance, held.address, held.item.payload) == ("w1", "tcp://w1:1", "job-r1")
    submit(core, "r2", SHORT)          # w1 is now estimated at 100 + 1000: w2 (500) is least loaded
    assert [h.instance for h in core.pump()] == ["w2"]


def test_the_group_with_the_most_headroom_pulls_first(clock):
    core = make(clock, rank("a0", "A", tokens=20_000), rank("a1", "A", tokens=0),
                rank("b0", "B", tokens=5000), rank("b1", "B", tokens=5000), bucket_bounds=())
    assert core.assignment == {"A": 0, "B": 0}     # one bucket: both groups serve it
    submit(core, "r1", SHORT)
    [held] = core.pump()
    assert held.instance in ("b0", "b1")    # B's mean load 5000 < A's 10000, though a1 alone is idler
    assert held.instance == "b0"            # equal ranks: by name


def test_no_headroom_queues_then_headroom_dispatches_in_arrival_order(clock):
    core = make(clock, rank("w0", tokens=40_000), rank_token_budget=32_768)
    for i in range(3):
        submit(core, f"r{i}", SHORT)
    assert core.pump() == [] and core.queued() == 3
    core.update_ranks([rank("w0", tokens=31_800)])          # its heartbeat shows headroom again
    assert [h.request_id for h in core.pump()] == ["r0"]    # 31.8k reported + 1k handed out since: full
    assert core.rank_tokens("w0") == 32_800
    core.update_ranks([rank("w0", tokens=0, seen_at=clock.now + 1)])   # a later heartbeat: idle
    handed = core.pump()
    assert [h.request_id for h in handed] == ["r1", "r2"]   # the router's own count stays under budget
    assert core.rank_tokens("w0") == 3000


def test_the_admitted_value_lands_in_the_hand_out(clock):
    core = make(clock, rank("w0"))
    for i in range(2):
        submit(core, f"r{i}", SHORT)
    handed = core.pump(admit=lambda item: f"slot-{item.request_id}")
    assert [(h.request_id, h.admitted) for h in handed] == [("r0", "slot-r0"), ("r1", "slot-r1")]
    submit(core, "r2", SHORT)
    assert core.pump()[0].admitted is True              # no admit: admitted by default


def test_a_none_admission_stops_the_pump_and_keeps_the_order(clock):
    core = make(clock, rank("w0"))
    for i in range(4):
        submit(core, f"r{i}", SHORT)
    slots = ["s0"]                                      # room for one request only
    asked = []

    def admit(item):
        asked.append(item.request_id)
        return slots.pop(0) if slots else None

    assert [(h.request_id, h.admitted) for h in core.pump(admit=admit)] == [("r0", "s0")]
    assert asked == ["r0", "r1"] and core.queued() == 3 and core.outstanding() == 1
    assert core.rank_tokens("w0") == SHORT              # the refused head was not handed to the rank
    assert core.pump(admit=lambda item: None) == [] and core.queued() == 3
    slots.extend(["s1", "s2", "s3"])
    assert [(h.request_id, h.admitted) for h in core.pump(admit=admit)] == [("r1", "s1"), ("r2", "s2"),
                                                                           ("r3", "s3")]
    assert core.stats.dispatched == 4


def test_a_none_admission_stops_every_bucket_not_just_the_oldest(clock):
    core = make(clock, rank("w0"), rank("w1"), rank("w2"), rank("w3"))
    submit(core, "short", SHORT)
    submit(core, "long", LONG)
    asked = []

    def admit_only_long(item):
        asked.append(item.request_id)
        return "slot" if item.request_id == "long" else None

    assert core.pump(admit=admit_only_long) == [] and asked == ["short"]   # the oldest waits: all wait
    assert core.queue_lengths() == [1, 0, 1, 0]
    assert [h.request_id for h in core.pump(admit=lambda item: True)] == ["short", "long"]


def test_admission_is_asked_only_when_a_rank_has_headroom(clock):
    core = make(clock, rank("w0", tokens=40_000), rank_token_budget=32_768)
    submit(core, "r0", SHORT)
    asked = []
    assert core.pump(admit=lambda item: asked.append(item.request_id) or "slot") == []
    assert asked == []                                  # no decode slot taken for work with no rank
    core.update_ranks([rank("w0", tokens=0)])
    assert [h.admitted for h in core.pump(admit=lambda item: asked.append(item.request_id) or "slot")] == ["slot"]
    assert asked == ["r0"]


def test_a_heartbeat_older_than_a_hand_out_does_not_hide_it(clock):
    core = make(clock, rank("w0", seen_at=clock.now))
    submit(core, "a", SHORT)
    core.pump()
    clock.now += 0.5
    core.update_ranks([rank("w0", tokens=0, seen_at=clock.now)])   # built before "a" arrived there
    assert core.rank_tokens("w0") == SHORT and core.rank_requests("w0") == 1
    core.update_ranks([rank("w0", tokens=250, in_flight=1, seen_at=clock.now)])   # "a" part done
    assert core.rank_tokens("w0") == SHORT


def test_work_from_elsewhere_adds_to_what_the_router_handed_out(clock):
    core = make(clock, rank("w0", tokens=5000, in_flight=3))
    submit(core, "a", SHORT)
    core.pump()
    assert core.rank_tokens("w0") == 6000 and core.rank_requests("w0") == 4


def test_a_rank_stops_pulling_once_its_handed_out_tokens_reach_the_budget(clock):
    core = make(clock, rank("w0"), rank_token_budget=2500)
    for i in range(4):
        submit(core, f"r{i}", SHORT)
    assert [h.request_id for h in core.pump()] == ["r0", "r1", "r2"]   # 0, 1000, 2000 < 2500; 3000 is not
    assert core.queued() == 1
    core.finish("r0")
    assert [h.request_id for h in core.pump()] == ["r3"]


def test_uncached_tokens_count_toward_the_budget_not_cached_ones(clock):
    core = make(clock, rank("w0"), rank_token_budget=2000)
    for i in range(5):
        submit(core, f"r{i}", 3000, hit=2560)        # 440 uncached each
    assert len(core.pump()) == 5
    assert core.rank_tokens("w0") == 2200


def test_reported_capacity_limits_requests_per_rank(clock):
    core = make(clock, rank("w0", capacity=2))
    for i in range(3):
        submit(core, f"r{i}", 10)
    assert len(core.pump()) == 2
    core.finish("r1")
    assert [h.request_id for h in core.pump()] == ["r2"]


def test_draining_and_dead_ranks_take_no_work(clock):
    core = make(clock, rank("w0", "g", accepts_work=False), rank("w1", "g"))
    submit(core, "r1", SHORT)
    assert [h.instance for h in core.pump()] == ["w1"]
    lost = core.rank_dead("w1")
    assert [h.request_id for h in lost] == ["r1"] and core.outstanding() == 0
    submit(core, "r2", SHORT)
    assert core.pump() == [] and core.queued() == 1     # only a draining rank is left
    assert core.assignment == {}


def test_a_bucket_queue_is_bounded_by_requests_and_by_tokens(clock):
    core = make(clock, queue_limit=2, queue_token_limit=25_000)
    submit(core, "a", SHORT)
    submit(core, "b", SHORT)
    with pytest.raises(Overloaded) as err:
        submit(core, "c", SHORT)
    assert err.value.code == ErrorCode.OVERLOADED and err.value.request_id == "c"
    submit(core, "d", 20_000)                # another bucket, its own bound
    with pytest.raises(Overloaded):
        submit(core, "e", 20_000)            # 40k waiting tokens would exceed 25k
    submit(core, "f", 100_000)               # one request alone always fits its empty bucket
    assert core.stats.refused == 2 and core.queued() == 4


def test_waiting_too_long_expires_oldest_first(clock):
    core = make(clock, max_queue_wait_s=30.0)
    submit(core, "a", SHORT)
    clock.now += 20
    submit(core, "b", SHORT)
    clock.now += 15
    assert [item.request_id for item in core.expire()] == ["a"]
    clock.now += 14
    assert core.expire() == []
    clock.now += 1
    assert [item.request_id for item in core.expire()] == ["b"]
    assert core.queued() == 0 and core.stats.expired == 2


def test_bad_or_duplicate_requests_are_refused(clock):
    core = make(clock, rank("w0"))
    submit(core, "a", SHORT)
    for args in (("a", SHORT, 0), ("", SHORT, 0), ("b", 0, 0), ("c", 100, 101), ("d", 100, -1)):
        with pytest.raises(InvalidRequest):
            core.submit(*args)
    core.pump()
    with pytest.raises(InvalidRequest):
        submit(core, "a", SHORT)          # still held by a rank


def test_cancel_removes_a_request_wherever_it_is(clock):
    core = make(clock, rank("w0", capacity=1))
    submit(core, "a", SHORT)
    submit(core, "b", SHORT)
    core.pump()
    assert core.cancel("b").request_id == "b" and core.queued() == 0
    assert core.cancel("a").instance == "w0" and core.outstanding() == 0
    assert core.cancel("a") is None
    assert core.rank_tokens("w0") == 0


def test_drop_queued_and_outstanding_where_select_by_payload(clock):
    core = make(clock, rank("w0", capacity=1))
    submit(core, "a", SHORT)
    submit(core, "b", SHORT)
    core.pump()
    assert [h.request_id for h in core.outstanding_where(lambda item: item.payload == "job-a")] == ["a"]
    assert [i.request_id for i in core.drop_queued(lambda item: item.payload == "job-b")] == ["b"]


def test_an_idle_heartbeat_settles_work_whose_done_message_was_lost(clock):
    core = make(clock, rank("w0"), idle_settle_s=2.0)
    submit(core, "a", SHORT)
    core.pump()                                             # handed out at t=1000
    assert core.update_ranks([rank("w0", seen_at=1001.0)]) == []    # too soon: may not have arrived yet
    assert core.update_ranks([rank("w0", in_flight=1, seen_at=1005.0)]) == []   # busy: still working
    [settled] = core.update_ranks([rank("w0", seen_at=1005.0)])
    assert settled.request_id == "a" and core.outstanding() == 0 and core.stats.settled == 1


# ---- engines per bucket across rounds ---------------------------------------------------
def eight_groups(**load) -> list[RankView]:
    return [rank(f"w{i}", f"g{i}", **load) for i in range(8)]


def test_before_any_demand_groups_spread_evenly(clock):
    core = make(clock, *eight_groups())
    assert core.engines_per_bucket() == [2, 2, 2, 2]


def test_a_burst_of_long_requests_moves_engines_to_the_long_bucket(clock):
    core = make(clock, *eight_groups(), round_s=10.0)
    for i in range(20):
        submit(core, f"s{i}", SHORT)
    clock.now += 10
    core.pump()
    assert core.stats.rounds == 1
    assert core.engines_per_bucket() == [8, 0, 0, 0]      # only short demand last round
    for i in range(40):
        core.finish(f"s{i}")
    for i in range(10):
        submit(core, f"s2-{i}", SHORT)
    for i in range(3):
        submit(core, f"l{i}", HUGE)                          # a burst of long prompts
    assert core.engines_per_bucket()[3] >= 1                 # demand with no engine gets one at once
    clock.now += 10
    core.pump()
    engines = core.engines_per_bucket()
    assert engines[3] >= 6 and engines[0] >= 1 and sum(engines) == 8
    shares = core.quota_shares()
    assert shares[3] > 0.9 and abs(sum(shares) - 1.0) < 1e-9


def test_no_bucket_with_demand_drops_to_zero_engines(clock):
    core = make(clock, *eight_groups(), round_s=10.0)
    for round_no in range(5):
        for i in range(10):
            submit(core, f"h{round_no}-{i}", HUGE)
        submit(core, f"s{round_no}", SHORT)
        submit(core, f"m{round_no}", MEDIUM)
        clock.now += 10
        for held in core.pump():
            core.finish(held.request_id)
        engines = core.engines_per_bucket()
        assert engines[0] >= 1 and engines[1] >= 1 and engines[3] >= 5, engines
        assert engines[2] == 0          # no demand there: its engines went where the work is


def test_an_idle_round_keeps_the_last_shares(clock):
    core = make(clock, *eight_groups(), round_s=10.0)
    for i in range(5):
        submit(core, f"l{i}", HUGE)
    clock.now += 10
    core.pump()
    before = core.engines_per_bucket()
    clock.now += 100                     # nothing arrives for ten rounds
    core.pump()
    assert core.engines_per_bucket() == before and before[3] == 8


def test_rebalancing_moves_few_groups(clock):
    core = make(clock, *eight_groups(), round_s=10.0)
    start = dict(core.assignment)
    for i in range(40):
        submit(core, f"s{i}", SHORT)     # 40 x 5096^2 against 14096^2: shares 0.84 / 0.16
    submit(core, "m", MEDIUM)
    clock.now += 10
    core.pump()
    moved = [g for g in start if core.assignment[g] != start[g]]
    assert core.engines_per_bucket() == [7, 1, 0, 0]
    assert len(moved) == 5 and core.stats.moves == 5        # the 2 short and 1 medium group stay


def test_with_fewer_groups_than_demanding_buckets_requests_borrow_the_nearest(clock):
    core = make(clock, rank("w0", "g0"))
    submit(core, "s", SHORT)
    submit(core, "h", HUGE)
    handed = core.pump()
    assert sorted(h.request_id for h in handed) == ["h", "s"]
    assert sum(core.engines_per_bucket()) == 1


def test_a_group_that_joins_or_leaves_triggers_a_rebalance(clock):
    core = make(clock, *eight_groups()[:2])
    assert sum(core.engines_per_bucket()) == 2
    core.update_ranks(eight_groups()[:4])
    assert core.engines_per_bucket() == [1, 1, 1, 1]
    core.rank_dead("w3")
    assert sum(core.engines_per_bucket()) == 3 and "g3" not in core.assignment


def test_a_group_of_several_ranks_counts_as_one_engine(clock):
    ranks = [rank(f"w{i}", f"g{i // 4}") for i in range(8)]
    core = make(clock, *ranks)
    assert sum(core.engines_per_bucket()) == 2
    submit(core, "a", SHORT)
    [held] = core.pump()
    assert held.instance in {r.instance for r in ranks if core.assignment[r.group] == 0}


def test_each_bucket_is_served_by_its_own_groups(clock):
    core = make(clock, *eight_groups(), round_s=10.0)
    for rid, n in (("s", SHORT), ("m", MEDIUM), ("l", LONG), ("h", HUGE)):
        submit(core, rid, n)
    for held in core.pump():
        group = "g" + held.instance[1:]
        assert core.assignment[group] == held.item.bucket


def test_invalid_policies_are_refused():
    for bad in ({"round_s": 0}, {"queue_limit": 0}, {"rank_token_budget": 0}, {"bucket_bounds": (10, 5)},
                {"max_queue_wait_s": float("inf")}, {"idle_settle_s": -1.0}):
        with pytest.raises(ValueError):
            RouterPolicy(**bad)
