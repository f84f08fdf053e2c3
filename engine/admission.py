"""Admission of a request with the prefix it brings: one engine-thread call instead of several.

A prefill worker's cache hit used to take serial engine-thread commands (import the prefix from the
KV store, then add the request), and each waits for the step in progress. `admit` does both in the
one call (`EngineCore.admit`): it imports what the caller read, then adds the request. The import's
failure rule stays the caller's old one: a refused import (bad pages, a state that does not fit)
costs only the hit, the request is still added with what the engine can use.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class PrefixImport:
    """What `EngineCore.import_prefix` takes: the chain, one page per block, and the window + tails
    at a boundary of the chain (None: pages only)."""
    block_hashes: list[bytes]
    pages: Sequence
    boundary_state: tuple | None = None


@dataclass(slots=True)
class Admitted:
    usable_tokens: int        # prompt tokens the prefix cache can serve the request (after the import)
    import_error: str = ""    # why the import was refused ("" = it was not, or none was asked)
    added: bool = True        # False: `ready` said no; the caller completes the request and adds it


def admit(engine, request, prefix: PrefixImport | None, prefill_only: bool,
          ready: Callable[[int], bool] | None) -> Admitted:
    """On the engine thread: import `prefix` (if any), then add `request` unless `ready(usable
    tokens)` says the caller must complete it first (image embeddings the shorter hit now needs).
    A ValueError of add_request (a bad request) propagates; the import's is reported, not raised."""
    usable, error = 0, ""
    if prefix is not None:
        try:
            usable = engine.import_prefix(prefix.block_hashes, prefix.pages, prefix.boundary_state)
        except ValueError as exc:
            error = str(exc)
            usable = engine.kv.usable_prefix(list(prefix.block_hashes))   # what was already here
    if ready is not None and not ready(usable):
        return Admitted(usable, error, added=False)
    engine.add_request(request, prefill_only=prefill_only)
    return Admitted(usable, error)
