"""StoreReader: the store read directly from another process on the same directory (prefill workers).

It keeps its own copy of the index by tailing the index log the writer publishes (see indexlog.py):
an entry appears there only after its record is written and fsynced, so whatever the reader finds
is whole. It never writes. Every read verifies the record's checksums, key and expiry: a record
deleted under it (gc, eviction), torn or corrupt is a miss (and a corrupt one is forgotten here),
never a served page. Reads may also go straight to locations ("segment:offset:length") that a
`KvLookupReply` carried, with no index at all.

Thread-safe: refreshes and index changes take a lock; lookups and reads may run in parallel.
`refresh_interval_s` (monotonic seconds) bounds how often lookups and reads look at the log;
0 looks every time (a directory listing and an fstat: tens of microseconds). `read_threads` read and
verify large records in parallel (0 = inline).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np
import structlog

from kvstore import record as fmt
from kvstore.fileio import make_io
from kvstore.index import BlockIndex
from kvstore.indexlog import IndexLogTail
from kvstore.record import FormatError
from kvstore.segment import ReadRequest, plan_reads, read_records, serve


class StoreReader:
    def __init__(self, root: str, *, backend: str = "local", clock: Callable[[], float] = time.time,
                 refresh_interval_s: float = 0.0, read_threads: int = 2, log=None, io=None):
        self.root = root
        self.clock = clock
        self.refresh_interval_s = refresh_interval_s
        self.log = log or structlog.get_logger().bind(component="kv_store_reader")
        self.io = io or make_io(backend, root, self.log)
        self.index = BlockIndex()
        self.corrupt_records = 0
        self._tail = IndexLogTail(root)
        self._lock = threading.Lock()
        self._last_refresh = float("-inf")
        self._pool = ThreadPoolExecutor(read_threads, thread_name_prefix="kv-read") if read_threads else None
        self.refresh()

    def __len__(self) -> int:
        return len(self.index)

    @property
    def generation(self) -> int | None:
        return self._tail.generation

    def refresh(self) -> int:
        """Apply what the writer published since the last look; returns the entries applied."""
        with self._lock:
            self._last_refresh = time.monotonic()
            restarted, entries = self._tail.poll()
            index, start = (BlockIndex() if restarted else self.index), 0   # a new generation: built aside
            for i in np.flatnonzero(entries["kind"] != fmt.PUT).tolist():   # drops, in their place in order
                index.put_entries(entries[start:i])                          # the PUTs before, at once
                e = entries[i]
                if e["kind"] == fmt.DROP_SEGMENT:
                    index.drop_segment(int(e["seq"]))
                else:
                    index.drop_key(fmt.entry_key(e), int(e["seq"]), int(e["offset"]))
                start = i + 1
            index.put_entries(entries[start:])
            self.index = index
            return len(entries)

    def lookup(self, chain: Sequence[bytes], now: float | None = None) -> int:
        self._maybe_refresh()
        return self.index.longest_prefix(chain, self.clock() if now is None else now)

    def read(self, chain: Sequence[bytes], *, prefix: bool = True, layout: str = "", max_bytes: int | None = None,
             now: float | None = None) -> list:
        """Like SegmentStore.read: the leading intact pages of a chain, or one page or None per hash."""
        self._maybe_refresh()
        now = self.clock() if now is None else now
        requests, slots = plan_reads(self.index, chain, prefix, now)
        return self._serve(requests, slots, len(chain), prefix, layout, max_bytes, now)

    def read_locations(self, locations: Sequence[str], chain: Sequence[bytes] | None = None, *,
                       layout: str = "", now: float | None = None) -> list:
        """Pages at "segment:offset:length" locations (one page or None each); pass the chain to
        also require each record to carry its hash."""
        if chain is not None and len(chain) != len(locations):
            raise ValueError("one hash per location")
        now = self.clock() if now is None else now
        requests, slots = [], []
        for i, text in enumerate(locations):
            try:
                seq, offset, length = fmt.parse_location(text)
            except FormatError as exc:
                self.log.warning("kv_store.bad_location", location=text, error=str(exc))
                continue
            requests.append(ReadRequest(seq, offset, length, chain[i] if chain is not None else None))
            slots.append(i)
        return self._serve(requests, slots, len(locations), False, layout, None, now)

    def close(self) -> None:
        self._tail.close()
        if self._pool is not None:
            self._pool.shutdown()
        self.io.close_all()

    def __enter__(self) -> "StoreReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _maybe_refresh(self) -> None:
        if time.monotonic() - self._last_refresh >= self.refresh_interval_s:
            self.refresh()

    def _serve(self, requests, slots, count, prefix, layout, max_bytes, now) -> list:
        outcomes = read_records(self.io, self.root, requests, now, layout, stop_at_miss=prefix, max_bytes=max_bytes,
                                pool=self._pool)
        served = serve(requests, slots, outcomes, count, prefix, self.log)
        for req in served.corrupt:
            self.corrupt_records += 1
            if req.key is not None:
                with self._lock:
                    self.index.drop_key(req.key, req.seq, req.offset)
        return served.pages

