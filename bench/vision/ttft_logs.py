"""What the vision workers' logs say about `epd bench vision --ttft`'s requests.

A worker logs `vision.queued` (request_id, images, patches) when a job joins its queue and
`vision.batch` (images, encode_ms) when a batch has been encoded and sent. Its queue is first in,
first out and a batch takes the oldest images (services/vision_worker/queue.py), so a batch of k
images is the k images queued before the others still waiting: replaying the two events in log
order tells when each image was done. A cancelled job leaves the queue unlogged and would shift
the replay: the bench counts the prefill workers' `vision.retry` lines (what cancels a job; none
expected) beside the numbers, and a worker whose batches ask for more images than were queued is
left out (`unmatched`), not guessed.

Per request: vision ms = its first image queued at a worker -> its last image's batch done, the
workers' queueing, preprocessing and encoding (the leader's hop and the rows' way to the prefill
worker are not in it). Timestamps are the log lines' epoch seconds, one host clock.
"""
from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class WorkerLogs:
    queued_at: dict[str, float] = field(default_factory=dict)    # request id -> first image queued
    done_at: dict[str, float] = field(default_factory=dict)      # request id -> last image's batch done
    batch_encode_ms: list[tuple[float, float]] = field(default_factory=list)   # (done at, encode ms)
    patches: dict[str, dict[str, int]] = field(default_factory=dict)   # worker -> request id -> patches
    unmatched: list[str] = field(default_factory=list)           # workers whose batches could not be replayed

    def vision_s(self, request_ids) -> dict[str, float]:
        """Seconds per request id of `request_ids` that the logs saw from queue to done."""
        return {r: self.done_at[r] - self.queued_at[r] for r in request_ids
                if r in self.done_at and r in self.queued_at}

    def encode_ms_between(self, start: float, end: float) -> list[float]:
        return [ms for at, ms in self.batch_encode_ms if start <= at <= end]

    def patch_shares(self, request_ids) -> dict[str, int]:
        """Patches each worker was given of `request_ids`' images."""
        wanted = set(request_ids)
        return {worker: sum(p for r, p in by_request.items() if r in wanted)
                for worker, by_request in self.patches.items()}


def count_events(paths: list[Path], name: str) -> int:
    """Lines of event `name` in these logs."""
    needle = f'"event": "{name}"'
    return sum(line.count(needle) for path in paths for line in path.read_text(errors="replace").splitlines())


def read_worker_logs(paths: list[Path]) -> WorkerLogs:
    out = WorkerLogs()
    for path in paths:
        _replay(path.stem, path, out)
    return out


def _replay(worker: str, path: Path, out: WorkerLogs) -> None:
    waiting: deque[str] = deque()   # one request id per image, in queue order
    patches = out.patches.setdefault(worker, {})
    for line in path.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        kind = event.get("event")
        if kind == "vision.queued":
            request_id, ts = event.get("request_id", ""), float(event["ts"])
            waiting.extend([request_id] * int(event["images"]))
            out.queued_at[request_id] = min(ts, out.queued_at.get(request_id, ts))
            patches[request_id] = patches.get(request_id, 0) + int(event["patches"])
        elif kind == "vision.batch":
            ts, images = float(event["ts"]), int(event["images"])
            out.batch_encode_ms.append((ts, float(event["encode_ms"])))
            if images > len(waiting):
                out.unmatched.append(worker)
                return
            for _ in range(images):
                request_id = waiting.popleft()
                out.done_at[request_id] = max(ts, out.done_at.get(request_id, ts))
