"""GrammarCache: compiled grammars by constraint key, failures for a while, and one compile per key.

- Artifacts: LRU bounded by their total bytes (`max_bytes`); one larger than the budget is
  answered but not kept.
- Failures that are the constraint's own verdict (INVALID_REQUEST, GRAMMAR_UNSUPPORTED,
  GRAMMAR_TIMEOUT, a child that died compiling it) are kept `error_ttl_s`: a client retrying a
  pathological schema gets the same error at once instead of costing a process each time.
  Capacity refusals (OVERLOADED, DRAINING, no process running) are not kept.
- In flight: the gateway and the worker ask for the same key at nearly the same time; the second
  joins the first's compile. The compile runs in a task of its own, so a caller that gives up does
  not cancel it for the others (nor waste it: its result is cached).
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Awaitable, Callable

from messages.errors import GrammarTimeout, GrammarUnsupported, InvalidRequest, WireError
from services.grammar_compiler.pool import CompileCrashed

VERDICTS = (InvalidRequest, GrammarUnsupported, GrammarTimeout, CompileCrashed)
ENTRY_OVERHEAD_BYTES = 200   # key, bookkeeping: so a flood of tiny entries is bounded too

Compile = Callable[[], Awaitable[tuple[str, float]]]


@dataclass(slots=True, frozen=True)
class Compiled:
    """One answer: the artifact, or the typed failure (`error`) to send back instead."""
    grammar: str
    compile_ms: float
    source: str      # "compiled" (this call ran it), "joined" (one under way), "cached" ("refused": service.py)
    error: WireError | None = None


@dataclass(slots=True)
class _Entry:
    grammar: str
    compile_ms: float
    nbytes: int
    error: WireError | None = None
    expires_at: float = float("inf")


@dataclass(slots=True)
class CacheStats:
    hits: int = 0          # answered from a cached artifact
    error_hits: int = 0    # answered from a cached failure
    joins: int = 0         # joined a compile under way
    misses: int = 0        # started a compile
    evictions: int = 0     # entries dropped to stay under max_bytes


class GrammarCache:
    def __init__(self, max_bytes: int, error_ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.max_bytes = max_bytes
        self.error_ttl_s = error_ttl_s
        self.clock = clock
        self.stats = CacheStats()
        self.bytes = 0
        self._entries: OrderedDict[str, _Entry] = OrderedDict()   # least recently used first
        self._in_flight: dict[str, asyncio.Task] = {}

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    async def get(self, key: str, compile: Compile) -> Compiled:
        """The answer for `key`: cached, joined, or compiled now with `compile()`. A failure comes back
        in `error` (a fresh copy for every caller) rather than raised, with where it came from."""
        entry = self._lookup(key)
        if entry is not None:
            if entry.error is not None:
                self.stats.error_hits += 1
                return Compiled("", 0.0, "cached", _copy(entry.error))
            self.stats.hits += 1
            return Compiled(entry.grammar, entry.compile_ms, "cached")
        task = self._in_flight.get(key)
        if task is None:
            self.stats.misses += 1
            task = self._in_flight[key] = asyncio.ensure_future(self._compile(key, compile))
            task.add_done_callback(_retrieve)
            source = "compiled"
        else:
            self.stats.joins += 1
            source = "joined"
        try:
            grammar, compile_ms = await asyncio.shield(task)
        except WireError as exc:
            return Compiled("", 0.0, source, _copy(exc))
        return Compiled(grammar, compile_ms, source)

    async def close(self) -> None:
        tasks = list(self._in_flight.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- internals ---------------------------------------------------------------------
    async def _compile(self, key: str, compile: Compile) -> tuple[str, float]:
        try:
            grammar, compile_ms = await compile()
        except VERDICTS as exc:
            self._put(key, _Entry("", 0.0, len(exc.message) + ENTRY_OVERHEAD_BYTES, exc,
                                  self.clock() + self.error_ttl_s))
            raise
        finally:
            self._in_flight.pop(key, None)
        self._put(key, _Entry(grammar, compile_ms, len(grammar.encode()) + ENTRY_OVERHEAD_BYTES))
        return grammar, compile_ms

    def _lookup(self, key: str) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expires_at <= self.clock():
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return entry

    def _put(self, key: str, entry: _Entry) -> None:
        if key in self._entries:
            self._drop(key)
        if entry.nbytes > self.max_bytes:
            return
        while self.bytes + entry.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
            self.stats.evictions += 1
        self._entries[key] = entry
        self.bytes += entry.nbytes

    def _drop(self, key: str) -> None:
        self.bytes -= self._entries.pop(key).nbytes


def _copy(error: WireError) -> WireError:
    return type(error)(error.message)


def _retrieve(task: asyncio.Task) -> None:
    """Every caller may have given up: the outcome is cached, so its exception is not 'lost'."""
    if not task.cancelled():
        task.exception()
