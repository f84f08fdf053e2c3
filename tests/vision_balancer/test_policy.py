"""The leader's choice: fewest queued patches (ties: fewer jobs, then name); round robin in name
order, stable as workers come and go; random, reproducible with a seeded generator."""
from __future__ import annotations

import random

import pytest

from services.vision_balancer.policy import Chooser, WorkerQueue


def test_patches_picks_the_fewest_queued_patches_not_the_fewest_images():
    busy_with_one_large = WorkerQueue("a", patches=8000, jobs=1)
    busy_with_three_small = WorkerQueue("b", patches=4500, jobs=3)
    assert Chooser("patches").pick([busy_with_one_large, busy_with_three_small]).name == "b"


def test_patches_ties_go_to_fewer_jobs_then_to_the_first_name():
    chooser = Chooser("patches")
    assert chooser.pick([WorkerQueue("a", 100, 2), WorkerQueue("b", 100, 1)]).name == "b"
    assert chooser.pick([WorkerQueue("c", 0, 0), WorkerQueue("b", 0, 0)]).name == "b"


def test_round_robin_cycles_in_name_order_and_survives_a_worker_leaving():
    chooser = Chooser("round_robin")
    workers = [WorkerQueue("c"), WorkerQueue("a"), WorkerQueue("b")]
    assert [chooser.pick(workers).name for _ in range(4)] == ["a", "b", "c", "a"]
    assert chooser.pick([WorkerQueue("a"), WorkerQueue("c")]).name == "c"   # b left: the next after a


def test_random_is_reproducible_with_a_seed_and_ignores_queues():
    workers = [WorkerQueue("a", patches=10**6), WorkerQueue("b")]
    first, again = Chooser("random", random.Random(7)), Chooser("random", random.Random(7))
    assert [first.pick(workers).name for _ in range(20)] == [again.pick(workers).name for _ in range(20)]
    chooser = Chooser("random", random.Random(1))
    assert {chooser.pick(workers).name for _ in range(50)} == {"a", "b"}


def test_unknown_policy_and_empty_choice_are_errors():
    with pytest.raises(ValueError, match="unknown vision balancing policy 'least'"):
        Chooser("least")
    with pytest.raises(ValueError, match="no worker"):
        Chooser().pick([])
