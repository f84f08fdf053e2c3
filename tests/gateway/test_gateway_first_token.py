"""The prefill worker's early first token at the gateway, in-process over real ZeroMQ with test-helper
workers playing the prefill worker (a) and the decode worker (b): numbered chunks
(GenerateChunk.first_index) show each token once whichever copy of the first token comes first,
with its logprob, and the decode worker stays the stream's owner; a gap fails the request; a
hand-off that fails after the first token was streamed resumes exactly after it."""
from __future__ import annotations

import asyncio

import pytest

from messages import ErrorReply
from messages.common import FinishReason, Usage
from messages.errors import ErrorCode
from messages.generate import GenerateChunk
from tests.gateway.test_gateway_resume import WHOLE, reference, resume_stack  # noqa: F401 - fixture
from tests.helpers.test_helper_async import eventually
from tests.helpers.test_helper_streaming_worker import positional_token

SILENT = {"chunks": 0, "finish": False, "positional": True}   # takes the request, sends nothing by itself
TOKENS = 6


def logprob(index: int) -> float:
    return -0.25 - index / 8


def chunk(prompt: int, index: int, worker=None) -> GenerateChunk:
    """Output token `index` as greedy decoding makes it, with its logprob; `worker` names itself."""
    named = {"worker": worker.config.advertise, "worker_incarnation": worker.incarnation} if worker else {}
    return GenerateChunk([positional_token(prompt + index)], logprobs=[logprob(index)], first_index=index, **named)


async def started(http, a, rid: str) -> tuple[asyncio.Task, int]:
    """The request on its way (its answer: the task), taken by worker a; its prompt length."""
    pending = asyncio.create_task(answer_with_logprobs(http, rid))
    await eventually(lambda: rid in a.received, what="the request at worker a")
    return pending, len(a.received[rid].prompt_ids)


async def answer_with_logprobs(http, rid: str):
    async with http.post("/v1/chat/completions", headers={"x-request-id": rid},
                         json={**BODY_LOGPROBS, "max_tokens": TOKENS}) as r:
        return r.status, await r.json()


BODY_LOGPROBS = {"model": "deepseek-v4-tiny", "messages": [{"role": "user", "content": "Hi"}],
                 "thinking": {"type": "disabled"}, "logprobs": True}


@pytest.mark.parametrize("decode_copy_first", [False, True], ids=["prefill_copy_first", "decode_copy_first"])
async def test_the_first_token_from_both_workers_shows_once_and_the_decode_worker_owns_the_stream(
        resume_stack, decode_copy_first):
    gateway, _, a, b, http, _ = await resume_stack(SILENT, SILENT)
    expected = await reference(http, a, max_tokens=TOKENS)
    a.config.settings.update(SILENT)
    pending, prompt = await started(http, a, "req-1")
    tracked = gateway.pending["req-1"]
    if decode_copy_first:
        b.send_chunk(gateway.config.advertise, "req-1", chunk(prompt, 0, worker=b))
        await eventually(lambda: tracked.worker == b.config.advertise, what="the decode worker named")
        a.send_chunk(gateway.config.advertise, "req-1", chunk(prompt, 0))
    else:
        a.send_chunk(gateway.config.advertise, "req-1", chunk(prompt, 0))
        await eventually(lambda: tracked.received == 1, what="the prefill worker's first token")
        assert tracked.worker == ""                                # the prefill worker does not own it
        b.send_chunk(gateway.config.advertise, "req-1", chunk(prompt, 0, worker=b))
        await eventually(lambda: tracked.worker == b.config.advertise, what="the decode worker named")
    for index in range(1, TOKENS):
        b.send_chunk(gateway.config.advertise, "req-1", chunk(prompt, index))
    b.send_chunk(gateway.config.advertise, "req-1", GenerateChunk([], int(FinishReason.LENGTH), first_index=TOKENS,
                                                                  usage=Usage(prompt, 0, TOKENS)))
    status, body = await asyncio.wait_for(pending, 10)
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["message"]["content"] == expected["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] == TOKENS and choice["finish_reason"] == "length"
    assert [round(t["logprob"], 6) for t in choice["logprobs"]["content"]] == [logprob(i) for i in range(TOKENS)]
    assert a.aborts == [] and b.aborts == []


async def test_a_gap_in_the_numbered_stream_fails_the_request_and_stops_its_worker(resume_stack):
    gateway, _, a, b, http, _ = await resume_stack(SILENT, SILENT)
    pending, prompt = await started(http, a, "req-gap")
    a.send_chunk(gateway.config.advertise, "req-gap", chunk(prompt, 0, worker=a))
    a.send_chunk(gateway.config.advertise, "req-gap", chunk(prompt, 2))   # token 1 never came
    status, body = await asyncio.wait_for(pending, 10)
    assert status == 502 and "never came" in body["error"]["message"], body
    await eventually(lambda: ("req-gap", "stream_gap") in a.aborts, what="the worker told to stop")
    assert b.received == {}                                               # not a resume: a bug, not a death


async def test_a_hand_off_that_fails_after_the_first_token_resumes_right_after_it(resume_stack):
    gateway, router, a, b, http, _ = await resume_stack(SILENT, WHOLE)
    expected = await reference(http, a, max_tokens=TOKENS)
    a.config.settings.update(SILENT)
    pending, prompt = await started(http, a, "req-h")
    a.send_chunk(gateway.config.advertise, "req-h", chunk(prompt, 0))      # streamed before the hand-off
    await eventually(lambda: gateway.pending["req-h"].received == 1, what="the first token")
    router.send(gateway.config.advertise, ErrorReply(int(ErrorCode.PEER_DEAD), "decode worker died during the "
                "hand-off"), request_id="req-h")                           # the router's report of PrefillWork
    status, body = await asyncio.wait_for(pending, 10)
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] == TOKENS
    resumed = b.received["req-h#r1"]
    assert resumed.prompt_ids[prompt:] == [positional_token(prompt)] and resumed.sampling.max_tokens == TOKENS - 1
