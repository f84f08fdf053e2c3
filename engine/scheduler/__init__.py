"""Continuous batching over the paged KV state (see scheduler.py)."""

from engine.scheduler.scheduler import Scheduler
from engine.scheduler.sequence import Sequence, SequenceStatus

__all__ = ["Scheduler", "Sequence", "SequenceStatus"]
