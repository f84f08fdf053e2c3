"""3FS KV writer: the service shell (service.py) around the KV store library (`kvstore`).

It owns one store directory as its only writer: pages arrive as KvWritePages, lookups and reads as
KvLookup / KvReadPages; gc runs on a timer. The store itself (segments, index, TTL, eviction,
StoreReader for workers) is the `kvstore` package.
"""
