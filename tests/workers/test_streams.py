"""StreamTable, the workers' request bookkeeping without sockets: what goes out per engine output
(hand-off tokens first, once; the worker's address on the first chunk only; usage on the last),
when new blocks may need persisting, and which requests a gateway holds."""
from __future__ import annotations

import pytest

from engine.engine_core import RequestOutput
from messages.common import FinishReason
from messages.errors import InvalidRequest
from messages.generate import GenerateChunk
from services.runtime.tracing import SpanContext
from services.workers.streams import Stream, StreamTable, summary_fields

WORKER = "tcp://decode:1"


def stream(rid: str = "r", prompt: int = 10, gateway: str = "tcp://gw:1") -> Stream:
    return Stream(rid, gateway, SpanContext("t" * 32, "s" * 16), "sender", "StateHandoff", 100.0, prompt)


def output(rid: str = "r", tokens=(7,), finish=None, prompt: int = 10) -> RequestOutput:
    return RequestOutput(rid, list(tokens), finish, [], [], prompt, 0)


def test_a_request_streams_once_and_a_duplicate_is_refused():
    table = StreamTable(WORKER)
    table.open(stream())
    with pytest.raises(InvalidRequest, match="already running"):
        table.open(stream())
    assert len(table) == 1 and "r" in table
    assert table.close("r") is not None and table.close("r") is None and len(table) == 0


def test_hand_off_tokens_go_first_once_and_only_the_first_chunk_names_the_worker():
    table = StreamTable(WORKER)
    table.open(stream(), GenerateChunk([5]))
    first = table.ahead("r", now=101.0)
    assert [c.token_ids for c in first] == [[5]] and first[0].worker == WORKER
    assert table.ahead("r", now=102.0) == []
    step = table.on_output(output(tokens=(6,)), now=103.0)
    assert [c.token_ids for c in step.chunks] == [[6]] and step.chunks[0].worker == ""
    assert step.stream.completion_tokens == 2 and step.stream.first_token_at == 101.0


def test_hand_off_tokens_not_sent_yet_ride_ahead_of_the_first_output():
    table = StreamTable(WORKER)
    table.open(stream(), GenerateChunk([5]))
    step = table.on_output(output(tokens=(6,)), now=101.0)
    assert [c.token_ids for c in step.chunks] == [[5], [6]]
    assert [c.worker for c in step.chunks] == [WORKER, ""]


def test_usage_rides_on_the_last_chunk():
    table = StreamTable(WORKER)
    table.open(stream(prompt=10))
    assert table.on_output(output(tokens=(1,)), 1.0).chunks[0].usage is None
    step = table.on_output(output(tokens=(2,), finish=FinishReason.LENGTH), 2.0)
    last = step.chunks[-1]
    assert step.finished and last.finish_reason == int(FinishReason.LENGTH)
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (10, 2)


def test_persist_on_the_first_output_on_each_new_block_and_at_the_end():
    table = StreamTable(WORKER, block_tokens=4)
    table.open(stream(prompt=6))                                  # KV of 6 prompt tokens
    assert table.on_output(output(tokens=(1,)), 1.0).persist      # the prompt's blocks
    flags = [table.on_output(output(tokens=(t,)), 1.0).persist for t in range(2, 7)]
    # fed tokens after each: 8, 9, 10, 11, 12; KV exists for all but the last, so at 9 the second
    # block (tokens 4..7) is complete
    assert flags == [False, True, False, False, False]
    assert table.on_output(output(tokens=(9,), finish=FinishReason.STOP), 1.0).persist


def test_outputs_of_closed_requests_are_dropped_and_gateways_hold_their_requests():
    table = StreamTable(WORKER)
    table.open(stream("a", gateway="tcp://gw:1"))
    table.open(stream("b", gateway="tcp://gw:2"))
    table.open(stream("c", gateway="tcp://gw:1"))
    assert sorted(table.held_for("tcp://gw:1")) == ["a", "c"] and table.addresses() == {"tcp://gw:1", "tcp://gw:2"}
    table.close("a")
    assert table.on_output(output("a"), 1.0) is None


def test_the_summary_has_ttft_decode_time_and_counts():
    table = StreamTable(WORKER)
    table.open(stream(prompt=10), GenerateChunk([5]))
    table.ahead("r", now=100.5)
    step = table.on_output(output(tokens=(6,), finish=FinishReason.STOP), 101.0)
    fields = summary_fields(step.stream, "stop", now=101.5)
    assert fields["phases"] == {"ttft_ms": 500.0, "decode_ms": 1000.0}
    assert (fields["prompt_tokens"], fields["completion_tokens"], fields["outcome"]) == (10, 2, "stop")
    assert fields["type"] == "StateHandoff" and fields["handle_ms"] == 1500.0
