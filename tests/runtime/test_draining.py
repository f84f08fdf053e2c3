"""A draining service over real ZeroMQ (ipc, in-process): it still takes the parts of work it holds
(its `continuation_types`, e.g. a gateway's stream chunks) and refuses new work with DRAINING; and
an ErrorReply is never answered with another, so two draining services cannot bounce errors."""
from __future__ import annotations

import pytest

from messages import ErrorReply
from messages.common import FinishReason
from messages.control import Echo, ServiceState, StatusQuery
from messages.errors import ErrorCode, RemoteError
from messages.generate import AbortRequest, GenerateChunk
from services.runtime.service import Service
from tests.helpers.test_helper_async import eventually
from tests.helpers.test_helper_services import InProcessServices


class TestHelperStreamHolder(Service):
    """Test-only: holds one open stream ("req-1") the way a gateway does, until its last chunk."""

    kind = "test_helper_stream_holder"
    continuation_types = (GenerateChunk, ErrorReply)
    __test__ = False

    def __init__(self, config):
        super().__init__(config)
        self.open_streams = {"req-1"}
        self.chunks: list[list[int]] = []
        self.errors: list[int] = []

    def handlers(self):
        return {GenerateChunk: self._on_chunk, ErrorReply: self._on_error, AbortRequest: self._on_abort}

    def in_flight(self) -> int:
        return super().in_flight() + len(self.open_streams)

    async def _on_chunk(self, msg: GenerateChunk, ctx) -> None:
        self.chunks.append(msg.token_ids)
        if msg.finish_reason:
            self.open_streams.discard(ctx.request_id)

    async def _on_error(self, msg: ErrorReply, ctx) -> None:
        self.errors.append(msg.code)

    async def _on_abort(self, msg: AbortRequest, ctx) -> None:
        self.open_streams.discard(ctx.request_id)


class TestHelperNoContinuations(TestHelperStreamHolder):
    """Test-only: handles ErrorReply (as workers do) but takes nothing while draining."""

    kind = "test_helper_no_continuations"
    continuation_types = ()
    __test__ = False


def received(svc: Service, type_name: str) -> int:
    return svc.metrics._in.get(type_name, 0)


async def test_a_draining_service_finishes_held_streams_and_refuses_new_work(tmp_path):
    services = InProcessServices(tmp_path)
    holder = await services.start(TestHelperStreamHolder, "holder")
    worker = await services.start(Service, "worker")
    try:
        holder.begin_drain(grace_s=30.0)
        assert holder.state == ServiceState.DRAINING
        with pytest.raises(RemoteError) as refused:
            await worker.call(holder.config.advertise, Echo(b"new work"), request_id="req-2")
        assert refused.value.code == ErrorCode.DRAINING
        worker.send(holder.config.advertise, GenerateChunk([1, 2]), request_id="req-1")
        worker.send(holder.config.advertise, ErrorReply(int(ErrorCode.OVERLOADED), "a hiccup"), request_id="req-1")
        worker.send(holder.config.advertise, GenerateChunk([3], int(FinishReason.LENGTH)), request_id="req-1")
        await eventually(lambda: holder.state == ServiceState.STOPPED, 5, "the holder to drain and stop")
        assert holder.chunks == [[1, 2], [3]] and holder.errors == [ErrorCode.OVERLOADED]
    finally:
        await services.close()


async def test_two_draining_services_never_bounce_error_replies(tmp_path):
    services = InProcessServices(tmp_path)
    a = await services.start(TestHelperNoContinuations, "a")
    b = await services.start(TestHelperNoContinuations, "b")
    try:
        a.begin_drain(grace_s=30.0)
        b.begin_drain(grace_s=30.0)
        a.send(b.config.advertise, Echo(b"late"), request_id="req-9")   # b refuses it: DRAINING
        await eventually(lambda: received(a, "ErrorReply") >= 1, 5, "b's refusal to reach a")
        for _ in range(2):   # round trips on the same link: whatever either side answered has arrived
            await a.call(b.config.advertise, StatusQuery())
        assert received(a, "ErrorReply") == 1 and received(b, "ErrorReply") == 0
        assert a.errors == [] and a.metrics._errors.get("DRAINING") == 1   # refused, unanswered
    finally:
        a.open_streams.clear()
        b.open_streams.clear()
        await services.close()
