"""A vision worker's queue, pure: images waiting in arrival order, batches cut by a patch budget,
jobs that end when every image is sent, failed or cancelled.

`queued_patches` counts every image not yet resolved, the batch being encoded included: what the
worker still has to do, as its Load reports it (the leader balances by its own count of the same).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from messages.images import ImageInput


@dataclass(slots=True)
class WorkerJob:
    id: str                      # the leader's job id ("" for a job sent here directly)
    request_id: str
    reply_to: str
    attempt: int = 0             # VisionEncode.attempt, echoed in every answer
    from_leader: bool = False    # its leader expects a VisionDone
    span: Any = None             # the trace span the answers carry
    patches: int = 0
    remaining: int = 0           # images not yet resolved
    encoded: int = 0
    failed: int = 0
    cancelled: int = 0
    dropped: bool = False        # cancelled: images still in a batch are not sent


@dataclass(slots=True)
class Item:
    job: WorkerJob
    position: int                # the image's position in the request
    image: ImageInput

    @property
    def patches(self) -> int:
        return self.image.grid.patches


@dataclass(slots=True)
class PatchQueue:
    waiting: deque[Item] = field(default_factory=deque)
    jobs: dict[tuple[str, str], WorkerJob] = field(default_factory=dict)   # (request id, job id) -> job
    queued_patches: int = 0

    def add(self, job: WorkerJob, items: list[tuple[int, ImageInput]]) -> None:
        job.remaining = len(items)
        job.patches = sum(image.grid.patches for _, image in items)
        self.jobs[(job.request_id, job.id)] = job
        self.waiting.extend(Item(job, position, image) for position, image in items)
        self.queued_patches += job.patches

    def take_batch(self, max_patches: int) -> list[Item]:
        """The oldest images whose patches fit `max_patches` (the first one always: an image larger
        than the budget is encoded alone)."""
        batch: list[Item] = []
        total = 0
        while self.waiting and (not batch or total + self.waiting[0].patches <= max_patches):
            item = self.waiting.popleft()
            total += item.patches
            batch.append(item)
        return batch

    def resolve(self, item: Item, outcome: str) -> WorkerJob | None:
        """Count one image's outcome ("encoded", "failed", "cancelled"); the job if it has ended."""
        job = item.job
        setattr(job, outcome, getattr(job, outcome) + 1)
        job.remaining -= 1
        self.queued_patches -= item.patches
        if job.remaining:
            return None
        self.jobs.pop((job.request_id, job.id), None)
        return job

    def cancel(self, request_id: str, job_id: str = "") -> tuple[list[WorkerJob], int]:
        """Drop the request's waiting images (of one job if `job_id`): the jobs that ended by it, and
        how many images were dropped. Images already in a batch finish encoding, but are resolved as
        cancelled, not sent."""
        doomed = [job for (rid, jid), job in self.jobs.items() if rid == request_id and (not job_id or jid == job_id)]
        if not doomed:
            return [], 0
        for job in doomed:
            job.dropped = True
        kept: deque[Item] = deque()
        ended = []
        for item in self.waiting:
            if item.job.dropped:
                done = self.resolve(item, "cancelled")
                if done is not None:
                    ended.append(done)
            else:
                kept.append(item)
        dropped = len(self.waiting) - len(kept)
        self.waiting = kept
        return ended, dropped

    def __len__(self) -> int:
        return len(self.waiting)
