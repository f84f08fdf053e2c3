"""Test-only: the record headers a KV store directory holds (key, traffic class, expiry, write time), read
straight from its segment files, so a stack test can check what TTL each stored block got."""
from __future__ import annotations

import os

from kvstore import record as fmt
from kvstore.fileio import PosixIO
from kvstore.segment import scan_segment


def stored_records(root: str) -> list[fmt.RecordHeader]:
    """Every whole record of every segment under `root` (the kv_writer's `root`)."""
    io, out = PosixIO(), []
    folder = os.path.join(root, "segments")
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        seq = fmt.parse_segment_name(name)
        if seq is None:
            continue
        path = os.path.join(folder, name)
        scan = scan_segment(io, path, seq)
        fd = io.open_read(path)
        try:
            for offset in scan.entries["offset"].tolist():
                head = bytearray(fmt.max_header_len())
                got = io.pread_into(fd, offset, head)
                out.append(fmt.decode_record_header(memoryview(head)[:got]))
        finally:
            io.close(fd)
    return out
