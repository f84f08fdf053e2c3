"""A vision worker's queue: FIFO batches within the patch budget (an oversized image alone), jobs
ending when every image is resolved, cancel dropping only waiting images, queued patches exact."""
from __future__ import annotations

from services.vision_worker.queue import PatchQueue, WorkerJob
from tests.helpers.test_helper_vision import image_for_tests


def job_of(queue, job_id, request_id, sizes):
    job = WorkerJob(job_id, request_id, "tcp://prefill")
    queue.add(job, [(i, image_for_tests(w, h, salt=i)) for i, (w, h) in enumerate(sizes)])
    return job


def test_batches_are_cut_by_the_patch_budget_in_arrival_order():
    queue = PatchQueue()
    job_of(queue, "j1", "r1", [(8, 8), (8, 8), (16, 16)])   # 16, 16, 64 patches
    assert queue.queued_patches == 96
    assert [item.patches for item in queue.take_batch(40)] == [16, 16]
    assert [item.patches for item in queue.take_batch(40)] == [64]   # larger than the budget: alone
    assert queue.take_batch(40) == [] and queue.queued_patches == 96   # taken is not done


def test_a_job_ends_when_its_last_image_is_resolved():
    queue = PatchQueue()
    job = job_of(queue, "j1", "r1", [(8, 8), (8, 8)])
    first, second = queue.take_batch(100)
    assert queue.resolve(first, "encoded") is None
    assert queue.resolve(second, "failed") is job
    assert (job.encoded, job.failed, job.patches, queue.queued_patches, queue.jobs) == (1, 1, 32, 0, {})


def test_cancel_drops_waiting_images_and_marks_those_in_a_batch():
    queue = PatchQueue()
    job = job_of(queue, "j1", "r1", [(8, 8), (8, 8), (8, 8)])
    other = job_of(queue, "j2", "r2", [(8, 8)])
    (running,) = queue.take_batch(16)
    assert queue.cancel("r1") == ([], 2)   # one image still encoding: the job has not ended
    assert job.dropped and job.cancelled == 2 and len(queue) == 1 and not other.dropped
    assert queue.resolve(running, "cancelled") is job
    assert queue.queued_patches == 16


def test_cancel_of_one_job_leaves_the_request_other_jobs():
    queue = PatchQueue()
    first = job_of(queue, "j1", "r1", [(8, 8)])
    second = job_of(queue, "j2", "r1", [(8, 8)])
    assert queue.cancel("r1", "j1") == ([first], 1) and not second.dropped and len(queue) == 1
