"""3FS KV writer: block-KV pages persisted in segment files, the prefix index, TTL and GC.

`SegmentStore` is the writer's pure synchronous core, `StoreReader` reads the same directory from
another process, `KvWriterService` (service.py) is the asyncio shell.
"""
from services.kv_writer.reader import StoreReader
from services.kv_writer.settings import StoreError, StoreLocked, StoreSettings, StoreStats, WriteResult
from services.kv_writer.store import SegmentStore

__all__ = ["SegmentStore", "StoreError", "StoreLocked", "StoreReader", "StoreSettings", "StoreStats",
           "WriteResult"]
