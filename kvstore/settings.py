"""The KV store's settings, counters and errors (shared by the store, the service and the bench)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from kvstore.fileio import BACKENDS
from messages.common import TrafficClass
from messages.errors import InvalidRequest

DAY = 86400.0
FSYNC_POLICIES = ("none", "batch", "always")


def default_ttls() -> dict[str, float]:
    return {"agent": 3 * DAY, "chatbot": 7 * DAY}   # DeepSeek's: agent traffic 3 days, chatbot 7 days


@dataclass(slots=True, frozen=True)
class StoreSettings:
    root: str = ".epd/kvstore"
    backend: str = "local"                 # "local" or "3fs" (see fileio.py)
    segment_bytes: int = 256 << 20
    capacity_bytes: int = 64 << 30
    ttl_s: dict[str, float] = field(default_factory=default_ttls)   # traffic class name -> TTL
    slice_s: float = 3600.0                # expiry window shared by a segment's records
    fsync: str = "batch"
    refresh_fraction: float = 0.5
    max_open_segments: int = 8
    io_threads: int = 2                    # threads checksumming / reading large records in parallel

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}")
        if self.fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {FSYNC_POLICIES}")
        if self.segment_bytes < 4096 or self.capacity_bytes < self.segment_bytes:
            raise ValueError("segment_bytes must be >= 4096 and capacity_bytes >= segment_bytes")
        names = {c.name.lower() for c in TrafficClass}
        ttls = {**default_ttls(), **self.ttl_s}
        if set(ttls) - names or any(not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0)
                                    for v in ttls.values()):
            raise ValueError(f"ttl_s maps traffic classes {sorted(names)} to positive seconds")
        object.__setattr__(self, "ttl_s", ttls)
        if not (math.isfinite(self.slice_s) and self.slice_s > 0) or not 0 <= self.refresh_fraction <= 1:
            raise ValueError("slice_s must be > 0 and refresh_fraction in [0, 1]")
        if self.max_open_segments < 1 or self.io_threads < 0:
            raise ValueError("max_open_segments must be >= 1 and io_threads >= 0")

    @classmethod
    def keys(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def ttl_for(self, traffic_class: int) -> float:
        try:
            return self.ttl_s[TrafficClass(traffic_class).name.lower()]
        except ValueError:
            raise InvalidRequest(f"unknown traffic class {traffic_class!r}") from None


@dataclass(slots=True)
class StoreStats:
    records_written: int = 0
    bytes_written: int = 0
    records_skipped: int = 0
    write_errors: int = 0
    records_read: int = 0
    bytes_read: int = 0
    read_misses: int = 0         # records the index named that could not be served
    corrupt_records: int = 0     # of those, checksum or format failures
    lookups: int = 0
    lookup_blocks: int = 0
    lookup_hits: int = 0
    segments_evicted: int = 0
    records_evicted: int = 0
    segments_expired: int = 0    # dropped by gc
    records_expired: int = 0
    segments_recovered: int = 0  # unsealed at start (the writer had died): verified, cut, sealed
    rebuild_s: float = 0.0


@dataclass(slots=True, frozen=True)
class WriteResult:
    written: int
    skipped: int
    bytes: int = 0


class StoreLocked(RuntimeError):
    """Another writer process holds the store's directory."""


class StoreError(RuntimeError):
    """An I/O failure while writing (the records written before it were published)."""
