"""Length buckets, the compute quota, and engines per bucket by quota share."""
from __future__ import annotations

import pytest

from services.prefill_router.buckets import (DEFAULT_BOUNDS, QuotaModel, bucket_of, check_bounds,
                                             engine_targets, reassign)


@pytest.mark.parametrize("total, bucket", [
    (1, 0), (4096, 0), (4097, 1), (16384, 1), (16385, 2), (65536, 2), (65537, 3), (10**7, 3)])
def test_default_buckets_have_inclusive_upper_bounds(total, bucket):
    assert DEFAULT_BOUNDS == (4096, 16384, 65536)
    assert bucket_of(total) == bucket


def test_custom_bounds_give_one_more_bucket_than_bounds():
    bounds = (100, 1000)
    assert [bucket_of(n, bounds) for n in (1, 100, 101, 1000, 1001)] == [0, 0, 1, 1, 2]
    assert bucket_of(5, ()) == 0


@pytest.mark.parametrize("bad", [(0, 10), (10, 10), (20, 10), (1.5,), (True,), (-4,)])
def test_bad_bounds_are_refused(bad):
    with pytest.raises(ValueError):
        check_bounds(bad)


def test_quota_formula():
    q = QuotaModel(alpha=2.0, beta=3.0, theta=10.0)
    assert q(100, 0) == 2.0 * 110 ** 2
    assert q(100, 40) == 2.0 * 70 ** 2 + 3.0 * 40
    assert q(100, 100) == 2.0 * 10 ** 2 + 3.0 * 100


def test_default_quota_grows_quadratically_and_a_hit_makes_a_request_cheap():
    q = QuotaModel()
    assert (q.alpha, q.beta, q.theta) == (1.0, 1024.0, 4096.0)
    assert q(65536, 0) / q(4096, 0) > 50           # long uncached prompts dominate the demand
    assert q(65536, 65536 - 512) < q(8192, 0)       # a long prompt that is nearly all cached is cheap
    assert q(1000, 0) > q(1000, 512) > q(1000, 896)


def test_quota_refuses_bad_input():
    with pytest.raises(ValueError):
        QuotaModel()(100, 101)
    with pytest.raises(ValueError):
        QuotaModel()(100, -1)
    for bad in ({"alpha": -1.0}, {"theta": float("nan")}, {"beta": float("inf")}, {"alpha": 0.0, "beta": 0.0}):
        with pytest.raises(ValueError):
            QuotaModel(**bad)


def test_engines_follow_the_quota_share():
    assert engine_targets(8, [1.0, 1.0, 1.0, 5.0], [True] * 4) == [1, 1, 1, 5]
    assert engine_targets(10, [6.0, 2.0, 2.0, 0.0], [True, True, True, False]) == [6, 2, 2, 0]
    assert engine_targets(4, [3.0, 1.0, 0.0, 0.0], [True, True, False, False]) == [3, 1, 0, 0]


def test_every_demanding_bucket_keeps_an_engine_however_small_its_share():
    counts = engine_targets(8, [0.001, 0.0, 0.0, 1000.0], [True, False, True, True])
    assert counts == [1, 0, 1, 6]
    assert sum(counts) == 8


def test_fewer_engines_than_demanding_buckets_go_to_the_heaviest():
    assert engine_targets(2, [1.0, 5.0, 0.0, 3.0], [True, True, False, True]) == [0, 1, 0, 1]
    assert engine_targets(0, [1.0, 1.0], [True, True]) == [0, 0]


def test_no_demand_spreads_engines_evenly_shorter_buckets_first():
    assert engine_targets(6, [0.0] * 4, [False] * 4) == [2, 2, 1, 1]
    assert engine_targets(2, [0.0] * 4, [False] * 4) == [1, 1, 0, 0]


def test_targets_always_add_up():
    for engines in range(0, 20):
        for weights in ([1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 9.0, 0.0], [5.0, 0.0, 0.0, 5.0]):
            demanding = [w > 0 for w in weights]
            counts = engine_targets(engines, weights, demanding)
            assert sum(counts) == engines
            if engines >= sum(demanding):
                assert all(c >= 1 for c, d in zip(counts, demanding) if d)


def test_reassign_moves_as_few_groups_as_possible():
    current = {"g0": 0, "g1": 0, "g2": 0, "g3": 1}
    new = reassign(current, ["g0", "g1", "g2", "g3"], [2, 1, 0, 1], {"g0": 5.0, "g1": 1.0, "g2": 9.0})
    assert new["g3"] == 1
    assert new["g1"] == 3                       # the least-loaded group of bucket 0 leaves
    assert new["g0"] == new["g2"] == 0
    assert reassign(new, sorted(new), [2, 1, 0, 1], {}) == new   # same targets: nothing moves


def test_reassign_places_new_groups_where_the_shortfall_is_largest():
    new = reassign({"a": 0}, ["a", "b", "c"], [1, 0, 2, 0], {})
    assert new == {"a": 0, "b": 2, "c": 2}
    with pytest.raises(ValueError):
        reassign({}, ["a"], [1, 1], {})
