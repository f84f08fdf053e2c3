"""The E/P/D stack as real processes with workers that take 4 requests at a time: a burst of 40
concurrent streams queues instead of being refused, and every stream completes."""
from __future__ import annotations

import asyncio
from importlib import resources

import openai
import pytest

from tests.conftest import MODEL_NAME
from tests.helpers.test_helper_stack import down_stack, up_stack

pytestmark = pytest.mark.slow
STREAMS = 40


@pytest.fixture(scope="module")
def small_stack(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("capacity")
    text = (resources.files("ops.topologies") / "default.toml").read_text()
    assert text.count("max_num_seqs = 32") == 2     # the prefill and the decode worker
    path = root / "small.toml"
    path.write_text(text.replace("max_num_seqs = 32", "max_num_seqs = 4"))
    stack = up_stack(root, str(path), tiny_model_dir)
    yield stack
    down_stack(stack)


async def one_stream(client: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
    stream = await client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": f"Stream {i}: count to ten."}], max_tokens=6,
        stream=True, stream_options={"include_usage": True}, extra_body={"thinking": {"type": "disabled"}})
    finish, completion = "", 0
    async for event in stream:
        if event.choices and event.choices[0].finish_reason:
            finish = event.choices[0].finish_reason
        if event.usage:
            completion = event.usage.completion_tokens
    return finish, completion


def test_forty_streams_on_workers_of_four_all_complete(small_stack):
    async def burst():
        async with openai.AsyncOpenAI(base_url=small_stack["url"] + "/v1", api_key="unused", max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(*(one_stream(client, i) for i in range(STREAMS)), return_exceptions=True)

    results = asyncio.run(burst())
    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, f"{len(failures)} of {STREAMS} failed, e.g. {failures[0]!r}"
    assert all(finish in ("length", "stop") and completion >= 1 for finish, completion in results), results
