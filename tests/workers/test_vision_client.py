"""The prefill side's VisionClient against real leaders and workers (in-process, real ZeroMQ): a
random first group and another for the one retry; a group with no worker is passed over; a group
that runs past the timeout is cancelled and the images come from another; an earlier attempt's
failures do not fail the retry."""
from __future__ import annotations

import asyncio
import random

import pytest
import torch

from messages.errors import ErrorCode
from messages.vision import VisionFailed
from services.workers.vision_client import VisionClient, VisionError
from tests.helpers.test_helper_async import eventually
from tests.helpers.test_helper_services import InProcessServices
from tests.helpers.test_helper_vision import (VisionClientHostForTests, VisionPoolForTests, VisionWorkerForTests,
                                              expected_rows, image_for_tests)


class FirstGroupForTests(random.Random):
    """Test-only: 'random' choices that take the first group listed."""

    def choice(self, seq):
        return seq[0]

    def shuffle(self, seq):
        pass   # the groups stay in the order listed


@pytest.fixture
async def services(tmp_path):
    services = InProcessServices(tmp_path)
    pools: list[VisionPoolForTests] = []
    yield services, pools
    for pool in pools:
        for worker in pool.workers:
            if worker.encoder is not None and worker.encoder.gate is not None:
                worker.encoder.gate.set()
    await services.close()


async def two_groups(services, pools, first_workers: int):
    client = await services.start(VisionClientHostForTests, "prefill")
    client.vision.rng = FirstGroupForTests()
    first = await VisionPoolForTests(services).start(workers=first_workers, name="g1", client=client)
    second = await VisionPoolForTests(services).start(workers=1, name="g2", client=client)
    pools += [first, second]
    return client, first, second


def test_the_first_group_is_random_and_the_retries_take_the_others():
    client = VisionClient(service=None, rng=random.Random(0))
    groups = ["a", "b", "c"]
    picks = [client._leaders(groups) for _ in range(200)]
    assert {order[0] for order in picks} == set(groups) and all(sorted(order) == groups for order in picks)
    assert client._leaders(["only"]) == ["only"]
    with pytest.raises(ValueError):
        VisionClient(service=None, timeout_s=0)


async def test_a_group_without_workers_is_passed_over(services):
    client, first, second = await two_groups(*services, first_workers=0)
    image = image_for_tests(8, 8)
    (rows,) = await client.vision.encode("r1", [image], [first.address, second.address])
    assert torch.equal(rows, expected_rows(image)) and second.workers[0].encoder.batches == [[16]]


async def test_a_group_past_the_timeout_is_cancelled_and_another_encodes(services):
    client, first, second = await two_groups(*services, first_workers=1)
    client.vision.timeout_s = 0.3   # the behaviour under test: a group that does not answer in time
    stuck = first.workers[0]
    gate = first.gate(stuck)
    images = [image_for_tests(8, 8), image_for_tests(12, 12)]
    rows = await client.vision.encode("r1", images, [first.address, second.address])
    assert all(torch.equal(r, expected_rows(i)) for r, i in zip(rows, images))
    await eventually(lambda: not first.leader.core.jobs or all(j.cancelled for j in first.leader.core.jobs.values()),
                     what="the first group's jobs cancelled")
    gate.set()
    await eventually(lambda: not first.leader.core.jobs, what="the stuck job reported done")
    assert stuck.counts.images == 0 and stuck.counts.cancelled == 2   # encoded, but never sent


async def test_an_earlier_attempt_failure_does_not_fail_the_retry(services):
    client, first, second = await two_groups(*services, first_workers=1)
    gate = second.gate(second.workers[0])
    image = image_for_tests(8, 8)
    # the first attempt fails over (its group drains away), the retry on the second group is held
    first.workers[0].begin_drain()
    await eventually(lambda: not first.leader.workers(), what="the first group empty")
    task = asyncio.create_task(client.vision.encode("r1", [image], [first.address, second.address]))
    await eventually(second.workers[0].encoder.entered.is_set, what="the retry encoding")
    late = VisionFailed(0, int(ErrorCode.PEER_DEAD), "an old attempt's failure", attempt=0)
    first.leader.send(client.config.advertise, late, request_id="r1")
    await eventually(lambda: client.metrics._in.get("VisionFailed") == 1, what="the late failure received")
    gate.set()
    (rows,) = await task
    assert torch.equal(rows, expected_rows(image))


async def test_a_failure_of_the_current_attempt_is_raised_at_once(services):
    client, first, second = await two_groups(*services, first_workers=1)
    bad = image_for_tests(8, 8, data=b"not an image")
    with pytest.raises(VisionError) as failed:
        await client.vision.encode("r1", [image_for_tests(8, 8), bad], [first.address, second.address])
    assert failed.value.code == ErrorCode.INVALID_REQUEST and failed.value.index == 1
    assert second.workers[0].counts.batches == 0   # not retried: another group would refuse it too



async def test_a_group_whose_only_worker_restarts_is_asked_again_until_it_is_back(services):
    """Every group refuses at once (no worker running, as while one restarts after a crash): the
    client backs off and asks again within its deadline instead of failing the request."""
    client, first, _ = await two_groups(*services, first_workers=0)
    image = image_for_tests(8, 8)
    task = asyncio.create_task(client.vision.encode("r1", [image], [first.address]))
    await eventually(lambda: first.leader.metrics._in.get("VisionEncode", 0) >= 2, what="refused and asked again")
    assert not task.done()
    worker = await services[0].start(VisionWorkerForTests, "g1-late", upstream=first.address,
                                     settings={"model_dir": "unused", "warmup": False})
    (rows,) = await task
    assert torch.equal(rows, expected_rows(image)) and worker.counts.images == 1
