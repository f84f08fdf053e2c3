"""fail_streams: after a failed engine step every stream's gateway gets the error chunk, even when
one of them cannot be reached."""
from __future__ import annotations

from types import SimpleNamespace

from messages.common import FinishReason
from messages.errors import PeerDead
from services.workers.chunks import fail_streams


class RecordingSender:
    """Test-only: a service whose send() records, and fails for one address."""

    def __init__(self, unreachable: str):
        self.unreachable, self.sent = unreachable, []

    def send(self, address, message, *, request_id, span):
        if address == self.unreachable:
            raise PeerDead(f"{address} is gone")
        self.sent.append((address, request_id, message))


def test_every_reachable_gateway_gets_the_error_chunk():
    service = RecordingSender(unreachable="tcp://gone:1")
    streams = [(f"r{i}", SimpleNamespace(return_address=addr, span=None))
               for i, addr in enumerate(["tcp://a:1", "tcp://gone:1", "tcp://b:1"])]
    fail_streams(service, streams)
    assert [(a, r) for a, r, _ in service.sent] == [("tcp://a:1", "r0"), ("tcp://b:1", "r2")]
    chunk = service.sent[0][2]
    assert chunk.finish_reason == int(FinishReason.ERROR) and chunk.error == "engine failure" and not chunk.token_ids
