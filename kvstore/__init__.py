"""The KV store as a library: block-KV pages in segment files, the prefix index, TTL and GC.

Pure and synchronous; numpy, no tensor library. `SegmentStore` is the one writer of a store directory (writes, gc,
eviction; the kv_writer service runs it), `StoreReader` reads the same directory from any other
process (prefill workers). Pages go in as numpy arrays, bytes or (TensorDesc, buffer) pairs and come
back as (TensorDesc, memoryview) pairs; workers convert them to engine tensors (services/workers/tensors.py).

  record.py    the bytes on disk (records, segment headers and footers, index entries)
  segment.py   one segment file: append, seal, scan, read records back
  space.py     the writer's set of segments: rebuild at start, expiry gc, capacity eviction
  store.py     SegmentStore: the write path, reads, gc
  index.py     BlockIndex (table.py: its hash table), indexkeys.py: keys as words
  indexlog.py  the index log the writer publishes for readers
  reader.py    StoreReader
  fileio.py    POSIX and 3FS USRBIO I/O
  settings.py  StoreSettings, StoreStats, errors
"""
from kvstore.reader import StoreReader
from kvstore.settings import StoreError, StoreLocked, StoreSettings, StoreStats, WriteResult
from kvstore.store import SegmentStore

__all__ = ["SegmentStore", "StoreError", "StoreLocked", "StoreReader", "StoreSettings", "StoreStats",
           "WriteResult"]
