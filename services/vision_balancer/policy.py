"""Which vision worker of a group takes the next image: the leader's choice, pure.

`patches` is DeepSeek's rule: the worker with the fewest queued patches (the leader's own count:
added on dispatch, removed when the worker reports the job done), ties to the one with fewer jobs
in flight, then to the first by name. `round_robin` and `random` ignore the queues; they exist for
`epd bench vision`, which measures what counting patches buys.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

POLICIES = ("patches", "round_robin", "random")


@dataclass(slots=True)
class WorkerQueue:
    name: str
    patches: int = 0    # queued patches given to it and not yet reported done
    jobs: int = 0       # jobs given to it and not yet reported done


class Chooser:
    def __init__(self, policy: str = "patches", rng: random.Random | None = None):
        if policy not in POLICIES:
            raise ValueError(f"unknown vision balancing policy {policy!r} (known: {', '.join(POLICIES)})")
        self.policy = policy
        self.rng = rng or random.Random()
        self._last = ""   # round_robin: the name picked last (stable when workers come and go)

    def pick(self, workers: Sequence[WorkerQueue]) -> WorkerQueue:
        if not workers:
            raise ValueError("no worker to choose from")
        if self.policy == "patches":
            return min(workers, key=lambda w: (w.patches, w.jobs, w.name))
        ordered = sorted(workers, key=lambda w: w.name)
        if self.policy == "random":
            return self.rng.choice(ordered)
        chosen = next((w for w in ordered if w.name > self._last), ordered[0])
        self._last = chosen.name
        return chosen
