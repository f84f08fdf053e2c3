"""The leader's books: images placed largest first on the least-loaded worker, one job per worker;
done / refused release a job's patches (only from the worker holding it); cancel marks; a dead
worker's jobs come back to be placed again."""
from __future__ import annotations

from services.vision_balancer.core import BalancerCore, Placement


def place(core, request_id, patches, workers=("w1", "w2")):
    return core.dispatch(request_id, list(workers), [Placement(i, p) for i, p in enumerate(patches)], None)


def test_one_request_spreads_over_the_group_largest_first():
    core = BalancerCore(prefix="x-")
    jobs = {job.worker: job for job in place(core, "r1", [100, 900, 500])}
    assert jobs["w1"].positions == [1] and jobs["w1"].patches == 900
    assert jobs["w2"].positions == [0, 2] and jobs["w2"].patches == 600
    assert all(job.id.startswith("x-") for job in jobs.values())
    assert (core.queued_patches("w1"), core.queued_patches("w2")) == (900, 600)


def test_the_next_image_goes_where_fewer_patches_are_queued():
    core = BalancerCore()
    place(core, "big", [5000], workers=["w1"])
    place(core, "small", [100, 100, 100], workers=["w2"])
    (job,) = place(core, "next", [400])
    assert job.worker == "w2"   # three images queued there, but fewer patches


def test_done_releases_the_patches_once_and_only_from_the_holder():
    core = BalancerCore()
    (job,) = place(core, "r1", [300], workers=["w1"])
    assert core.done(job.id, "w2") is None
    assert core.done(job.id, "w1") is job and core.queued_patches("w1") == 0
    assert core.done(job.id, "w1") is None and core.queues["w1"].jobs == 0


def test_cancel_marks_the_request_jobs_which_count_until_done():
    core = BalancerCore()
    jobs = place(core, "r1", [300, 200])
    place(core, "r2", [50])
    cancelled = core.cancel("r1")
    assert sorted(j.id for j in cancelled) == sorted(j.id for j in jobs) and all(j.cancelled for j in jobs)
    assert core.cancel("r1") == []
    assert core.queued_patches("w1") + core.queued_patches("w2") == 550


def test_a_dead_worker_returns_its_jobs_and_leaves_the_books():
    core = BalancerCore()
    place(core, "r1", [300, 200])
    orphans = core.orphaned("w1")
    assert [j.positions for j in orphans] == [[0]] and "w1" not in core.queues
    assert all(j.worker == "w2" for j in core.jobs.values())
    (again,) = core.dispatch("r1", ["w2"], [Placement(p, 300) for p in orphans[0].positions], None)
    assert core.queued_patches("w2") == 500 and again.positions == [0]


def test_a_refused_job_is_released():
    core = BalancerCore()
    (job,) = place(core, "r1", [300], workers=["w1"])
    assert core.refused(job.id, "w1") is job and core.queued_patches("w1") == 0 and not core.jobs
