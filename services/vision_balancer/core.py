"""The leader's books, pure: which worker holds which images of which request, and how many
patches each worker has queued by the leader's own count.

A request's images are placed one at a time, largest first (so one request's images spread over
the group), each on the worker the policy picks with the images placed so far counted; the images
one worker gets form one job. A job's patches count against its worker from dispatch until the
worker reports the job done, the worker dies, or it refuses the job. A dead worker's jobs come
back from `orphaned` for the shell to place again; a cancelled job is only waited for.
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Any, Sequence

from services.vision_balancer.policy import Chooser, WorkerQueue


@dataclass(slots=True)
class Job:
    id: str
    request_id: str
    worker: str                  # the worker instance holding it
    positions: list[int]         # its images' positions in the request
    patches: int                 # what it counts against the worker
    payload: list                # the shell's data per image (same order as positions)
    context: Any                 # the shell's data per request (where answers go, the trace span)
    cancelled: bool = False


@dataclass(slots=True)
class Placement:
    position: int                # the image's position in the request
    patches: int
    payload: Any = None


class BalancerCore:
    def __init__(self, policy: str = "patches", rng: random.Random | None = None, prefix: str = ""):
        self.chooser = Chooser(policy, rng)
        self.prefix = prefix                        # job ids start with it: unique across leader restarts
        self.queues: dict[str, WorkerQueue] = {}    # worker instance -> what it holds by our count
        self.jobs: dict[str, Job] = {}              # job id -> job
        self._ids = itertools.count(1)

    def dispatch(self, request_id: str, workers: Sequence[str], images: Sequence[Placement],
                 context: Any) -> list[Job]:
        """Place `images` on `workers` (instances that take work; at least one), count them, and
        return the jobs (one per worker that got images)."""
        if not workers:
            raise ValueError("no worker to place images on")
        candidates = [self.queues.setdefault(name, WorkerQueue(name)) for name in workers]
        shares: dict[str, list[Placement]] = {}
        for image in sorted(images, key=lambda p: -p.patches):
            queue = self.chooser.pick(candidates)
            queue.patches += image.patches
            if queue.name not in shares:
                queue.jobs += 1
            shares.setdefault(queue.name, []).append(image)
        jobs = []
        for worker, share in shares.items():
            share.sort(key=lambda p: p.position)
            job = Job(f"{self.prefix}{next(self._ids)}", request_id, worker, [p.position for p in share],
                      sum(p.patches for p in share), [p.payload for p in share], context)
            self.jobs[job.id] = job
            jobs.append(job)
        return jobs

    def done(self, job_id: str, worker: str) -> Job | None:
        """The worker finished the job; None if it does not hold it (a late report after a re-dispatch)."""
        job = self.jobs.get(job_id)
        if job is None or job.worker != worker:
            return None
        return self._release(job)

    def cancel(self, request_id: str) -> list[Job]:
        """Mark the request's jobs cancelled and return them (each still counts until done)."""
        jobs = [job for job in self.jobs.values() if job.request_id == request_id and not job.cancelled]
        for job in jobs:
            job.cancelled = True
        return jobs

    def orphaned(self, worker: str) -> list[Job]:
        """A worker died (or restarted): its jobs leave the books and come back to be placed again."""
        self.queues.pop(worker, None)
        jobs = [job for job in self.jobs.values() if job.worker == worker]
        for job in jobs:
            del self.jobs[job.id]
        return jobs

    def refused(self, job_id: str, worker: str) -> Job | None:
        """The worker refused the job (draining, full): released, to be placed elsewhere."""
        job = self.jobs.get(job_id)
        if job is None or job.worker != worker:
            return None
        return self._release(job)

    def queued_patches(self, worker: str) -> int:
        queue = self.queues.get(worker)
        return queue.patches if queue else 0

    def _release(self, job: Job) -> Job:
        del self.jobs[job.id]
        queue = self.queues.get(job.worker)
        if queue is not None:
            queue.patches -= job.patches
            queue.jobs -= 1
        return job
