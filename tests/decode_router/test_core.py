"""The decode score as pure functions: score = alpha*kv_usage (clamped) + beta*normalised batch, lowest
first; batch normalised by the worker's capacity or else by the widest eligible batch; pending
requests count; draining and full workers skipped; deterministic ties; empty when none fits."""
from __future__ import annotations

import pytest

from messages.control import Load
from services.decode_router.core import DecodeCandidate, DecodePolicy, rank, score


def worker(name: str, kv: float = 0.0, batch: int = 0, capacity: int = 0, accepts_work: bool = True):
    return DecodeCandidate(name, f"tcp://{name}:1", Load(batch_size=batch, kv_usage=kv, capacity=capacity),
                           accepts_work)


def names(ranked) -> list[str]:
    return [s.instance for s in ranked]


def test_score_weighs_kv_usage_and_batch_and_clamps_kv_usage():
    assert score(0.5, 0.25, alpha=2.0, beta=4.0) == 2.0
    assert score(0.5, 0.25) == 0.75                      # defaults weigh both equally
    assert score(1.7, 0.0) == 1.0 and score(-0.2, 0.5) == 0.5
    assert score(0.9, 0.9, alpha=0.0, beta=0.0) == 0.0


def test_the_lowest_score_ranks_first():
    workers = [worker("a", kv=0.9, batch=10), worker("b", kv=0.2, batch=40), worker("c", kv=0.5, batch=20)]
    ranked = rank(workers)
    # widest batch 40: a = 0.9 + 0.25 = 1.15, b = 0.2 + 1.0 = 1.2, c = 0.5 + 0.5 = 1.0
    assert names(ranked) == ["c", "a", "b"]
    assert [round(s.score, 6) for s in ranked] == [1.0, 1.15, 1.2]
    assert [s.batch for s in ranked] == [20, 10, 40]
    assert ranked[0].candidate.address == "tcp://c:1"


def test_kv_usage_alone_and_batch_alone_balance_differently():
    workers = [worker("long-ctx", kv=0.8, batch=4), worker("many-short", kv=0.3, batch=64)]
    assert names(rank(workers, policy=DecodePolicy(alpha=1.0, beta=0.0)))[0] == "many-short"
    assert names(rank(workers, policy=DecodePolicy(alpha=0.0, beta=1.0)))[0] == "long-ctx"
    assert names(rank(workers))[0] == "long-ctx"         # 0.8 + 4/64 < 0.3 + 1.0


def test_the_weights_scale_their_terms():
    ranked = rank([worker("a", kv=0.5, batch=1), worker("b", batch=2)], policy=DecodePolicy(alpha=2.0, beta=3.0))
    # widest 2: a = 2*0.5 + 3*0.5 = 2.5, b = 0 + 3*1.0 = 3.0
    assert [(s.instance, s.score) for s in ranked] == [("a", 2.5), ("b", 3.0)]


def test_batch_is_normalised_by_the_reported_capacity_when_there_is_one():
    # by the widest batch b (100) would look full and a (50) half full; by capacity a is 50/64
    # full and b only 100/512
    ranked = rank([worker("a", kv=0.1, batch=50, capacity=64), worker("b", kv=0.1, batch=100, capacity=512)])
    assert names(ranked) == ["b", "a"]
    assert ranked[0].score == pytest.approx(0.1 + 100 / 512)
    assert ranked[1].score == pytest.approx(0.1 + 50 / 64)


def test_without_capacity_batch_is_normalised_by_the_widest_eligible_batch():
    ranked = rank([worker("a", batch=30), worker("b", batch=60), worker("c", batch=0)])
    assert [(s.instance, s.score) for s in ranked] == [("c", 0.0), ("a", 0.5), ("b", 1.0)]
    assert [s.score for s in rank([worker("a"), worker("b")])] == [0.0, 0.0]    # all empty: no division
    # the widest batch is taken among eligible workers only, capacity-bounded ones included
    [only] = rank([worker("a", batch=10), worker("gone", batch=100, accepts_work=False),
                   worker("full", batch=200, capacity=200)])
    assert (only.instance, only.score) == ("a", 1.0)
    mixed = rank([worker("bounded", batch=50, capacity=100), worker("open", batch=10)])
    assert [(s.instance, s.score) for s in mixed] == [("open", 0.2), ("bounded", 0.5)]


def test_pending_requests_count_toward_the_batch():
    workers = [worker("a", batch=2), worker("b", batch=3)]
    assert names(rank(workers)) == ["a", "b"]
    ranked = rank(workers, {"a": 2})                     # a: 4 estimated, now the widest
    assert names(ranked) == ["b", "a"]
    assert [(s.batch, s.score) for s in ranked] == [(3, 0.75), (4, 1.0)]
    assert names(rank(workers, {"nobody": 9})) == ["a", "b"]   # pending of unknown workers is ignored


def test_a_negative_reported_batch_counts_as_empty():
    [s] = rank([worker("a", batch=-5)], {"a": 1})
    assert s.batch == 1


def test_ties_are_broken_by_batch_then_name():
    kv_only = DecodePolicy(alpha=1.0, beta=0.0)
    assert names(rank([worker("b", kv=0.5, batch=3), worker("c", kv=0.5, batch=2), worker("a", kv=0.5, batch=3)],
                      policy=kv_only)) == ["c", "a", "b"]
    assert names(rank([worker("z"), worker("m"), worker("q")])) == ["m", "q", "z"]


def test_draining_workers_are_skipped():
    assert names(rank([worker("idle-but-draining", accepts_work=False), worker("busy", kv=0.9, batch=9)])) \
        == ["busy"]


def test_workers_at_capacity_are_skipped():
    assert names(rank([worker("full", batch=8, capacity=8), worker("room", kv=0.99, batch=7, capacity=8),
                       worker("over", batch=9, capacity=8)])) == ["room"]


def test_pending_requests_fill_a_worker_to_its_capacity():
    workers = [worker("a", batch=1, capacity=3), worker("b", kv=0.9, batch=5)]
    assert names(rank(workers, {"a": 1})) == ["a", "b"]
    assert names(rank(workers, {"a": 2})) == ["b"]        # 1 reported + 2 pending = capacity 3


def test_no_eligible_worker_ranks_empty():
    assert rank([]) == []
    assert rank([worker("d", accepts_work=False)]) == []
    assert rank([worker("f", batch=4, capacity=4)]) == []
    assert rank([worker("p", capacity=2)], {"p": 2}) == []


def test_ranking_leaves_its_inputs_alone():
    workers, pending = [worker("a", batch=1), worker("b")], {"a": 1}
    first = rank(workers, pending)
    assert rank(workers, pending) == first and pending == {"a": 1}


def test_invalid_policies_are_refused():
    for bad in ({"alpha": -1.0}, {"beta": float("nan")}, {"alpha": float("inf")}, {"alpha": True}, {"beta": "1"}):
        with pytest.raises(ValueError):
            DecodePolicy(**bad)
