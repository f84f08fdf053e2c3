"""DecodeRouterCore: score = alpha*kv_usage + beta*normalised batch, lowest wins; dead and
draining workers skipped; recent picks count; deterministic ties; Overloaded when none."""
from __future__ import annotations

import pytest

from messages.control import Load
from messages.errors import ErrorCode, Overloaded
from services.decode_router.core import DecodeCandidate, DecodePolicy, DecodeRouterCore, score


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def worker(name: str, kv: float = 0.0, batch: int = 0, capacity: int = 0, accepts_work: bool = True):
    return DecodeCandidate(name, f"tcp://{name}:1", Load(batch_size=batch, kv_usage=kv, capacity=capacity),
                           accepts_work)


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_score_formula_clamps_kv_usage():
    assert score(0.5, 0.25, alpha=2.0, beta=4.0) == 2.0
    assert score(1.7, 0.0) == 1.0 and score(-0.2, 0.5) == 0.5


def test_the_lowest_score_wins(clock):
    core = DecodeRouterCore(clock=clock)
    workers = [worker("a", kv=0.9, batch=10), worker("b", kv=0.2, batch=40), worker("c", kv=0.5, batch=20)]
    ranked = core.rank(workers)
    # max batch 40: a = 0.9 + 0.25 = 1.15, b = 0.2 + 1.0 = 1.2, c = 0.5 + 0.5 = 1.0
    assert [s.instance for s in ranked] == ["c", "a", "b"]
    assert [round(s.score, 6) for s in ranked] == [1.0, 1.15, 1.2]
    assert core.pick(workers).instance == "c"


def test_kv_usage_alone_and_batch_alone_balance_differently(clock):
    workers = [worker("long-ctx", kv=0.8, batch=4), worker("many-short", kv=0.3, batch=64)]
    by_kv = DecodeRouterCore(DecodePolicy(alpha=1.0, beta=0.0), clock=clock)
    by_batch = DecodeRouterCore(DecodePolicy(alpha=0.0, beta=1.0), clock=clock)
    both = DecodeRouterCore(DecodePolicy(alpha=1.0, beta=1.0), clock=clock)
    assert by_kv.pick(workers).instance == "many-short"
    assert by_batch.pick(workers).instance == "long-ctx"
    assert both.pick(workers).instance == "long-ctx"       # 0.8 + 4/64 < 0.3 + 1.0


def test_batch_is_normalised_by_reported_capacity_when_there_is_one(clock):
    core = DecodeRouterCore(clock=clock)
    # by the max across workers b (100) would look full and a (50) half full; by capacity
    # a is 50/64 full and b only 100/512
    workers = [worker("a", kv=0.1, batch=50, capacity=64), worker("b", kv=0.1, batch=100, capacity=512)]
    ranked = core.rank(workers)
    assert [s.instance for s in ranked] == ["b", "a"]
    assert ranked[0].score == pytest.approx(0.1 + 100 / 512)


def test_batch_is_normalised_by_the_largest_batch_without_capacity(clock):
    core = DecodeRouterCore(clock=clock)
    ranked = core.rank([worker("a", batch=30), worker("b", batch=60), worker("c", batch=0)])
    assert [(s.instance, s.score) for s in ranked] == [("c", 0.0), ("a", 0.5), ("b", 1.0)]
    assert [s.score for s in core.rank([worker("a"), worker("b")])] == [0.0, 0.0]   # all empty


def test_ties_are_broken_by_batch_then_name(clock):
    core = DecodeRouterCore(DecodePolicy(alpha=1.0, beta=0.0), clock=clock)
    assert core.pick([worker("b", kv=0.5, batch=3), worker("c", kv=0.5, batch=2),
                      worker("a", kv=0.5, batch=3)]).instance == "c"
    core2 = DecodeRouterCore(clock=clock)
    assert core2.pick([worker("z"), worker("m"), worker("q")]).instance == "m"


def test_draining_workers_are_skipped(clock):
    core = DecodeRouterCore(clock=clock)
    assert core.pick([worker("idle-but-draining", accepts_work=False), worker("busy", kv=0.9, batch=9)]) \
        .instance == "busy"


def test_workers_at_capacity_are_skipped(clock):
    core = DecodeRouterCore(clock=clock)
    assert core.pick([worker("full", batch=8, capacity=8), worker("room", kv=0.99, batch=7, capacity=8)]) \
        .instance == "room"


def test_no_eligible_worker_is_overloaded(clock):
    core = DecodeRouterCore(clock=clock)
    for workers, why in (([], "alive"), ([worker("d", accepts_work=False)], "alive"),
                         ([worker("f", batch=4, capacity=4)], "capacity")):
        with pytest.raises(Overloaded) as err:
            core.pick(workers)
        assert err.value.code == ErrorCode.OVERLOADED and why in err.value.message
    assert core.stats.refused == 3 and core.stats.picks == 0


def test_recent_picks_count_until_heartbeats_can_show_them(clock):
    core = DecodeRouterCore(DecodePolicy(pick_hold_s=5.0), clock=clock)
    workers = [worker("a", batch=0), worker("b", batch=0)]
    picks = [core.pick(workers).instance for _ in range(6)]
    assert picks == ["a", "b", "a", "b", "a", "b"]          # a burst spreads instead of piling up
    assert core.pending("a") == 3
    clock.now += 5.0
    assert core.pending("a") == 0 and core.pick(workers).instance == "a"


def test_recent_picks_fill_a_worker_to_its_capacity(clock):
    core = DecodeRouterCore(clock=clock)
    workers = [worker("a", batch=1, capacity=2)]
    core.pick(workers)
    with pytest.raises(Overloaded):
        core.pick(workers)


def test_forget_drops_a_dead_workers_recent_picks(clock):
    core = DecodeRouterCore(clock=clock)
    core.pick([worker("a")])
    core.forget("a")
    assert core.pending("a") == 0


def test_invalid_policies_are_refused():
    for bad in ({"alpha": -1.0}, {"beta": float("nan")}, {"pick_hold_s": float("inf")}, {"alpha": True}):
        with pytest.raises(ValueError):
            DecodePolicy(**bad)
