"""The vision pool over real ZeroMQ in one process: a leader, its workers (the fake encoder) and a
prefill-side client. Rows of every image come back in order (float32 and bfloat16); a bad image is a
typed error and the worker serves on; the leader gives the next image to the worker with fewer
queued patches; a dead or draining worker's jobs finish on another; a cancel drops queued images."""
from __future__ import annotations

import asyncio

import pytest
import torch

from messages.errors import ErrorCode
from messages.images import ImageInput
from services.catalog import resolve
from services.runtime.service import Service
from services.runtime.settings import parse_settings
from services.vision_balancer.service import VisionBalancerService, VisionBalancerSettings
from services.vision_worker.service import VisionWorkerService, VisionWorkerSettings
from services.workers.vision_client import VisionError
from tests.helpers.test_helper_async import eventually
from tests.helpers.test_helper_services import InProcessServices
from tests.helpers.test_helper_vision import VisionPoolForTests, expected_rows, image_for_tests
from tests.messages.test_torch_free import modules_loaded_by


@pytest.fixture
async def pool(tmp_path):
    services = InProcessServices(tmp_path)
    pool = VisionPoolForTests(services)
    yield pool
    await pool.close()


def sample(service, name: str, **labels) -> float:
    return service.metrics.registry.get_sample_value(
        name, {"kind": service.kind, "instance": service.config.instance, **labels}) or 0.0


def test_kinds_settings_and_a_leader_that_never_loads_torch():
    assert resolve("vision_balancer") is VisionBalancerService and resolve("vision_worker") is VisionWorkerService
    with pytest.raises(ValueError, match="model_dir is required"):
        parse_settings(VisionWorkerSettings, {}, "vision_worker")
    with pytest.raises(ValueError, match="dtype must be one of"):
        parse_settings(VisionWorkerSettings, {"model_dir": "/m", "dtype": "int8"}, "vision_worker")
    with pytest.raises(ValueError, match="policy must be one of"):
        parse_settings(VisionBalancerSettings, {"policy": "fewest"}, "vision_balancer")
    assert "torch" not in modules_loaded_by("from services.catalog import resolve; resolve('vision_balancer')")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_every_image_comes_back_as_its_span_rows_in_order(pool, dtype):
    await pool.start(dtype=dtype)
    images = [image_for_tests(8, 8), image_for_tests(24, 16), image_for_tests(12, 12)]
    rows = await pool.encode("r1", images)
    torch_dtype = getattr(torch, dtype)
    for image, got in zip(images, rows):
        assert got.dtype == torch_dtype and torch.equal(got, expected_rows(image, torch_dtype))
    assert sorted(len(w.encoder.batches) > 0 for w in pool.workers) == [True, True]   # spread over the group
    await eventually(lambda: not pool.leader.core.jobs, what="jobs reported done")
    assert all(q.patches == 0 for q in pool.leader.core.queues.values())
    assert sum(sample(w, "epd_vision_images_total") for w in pool.workers) == 3
    assert sample(pool.leader, "epd_vision_balancer_patches_total") == sum(i.grid.patches for i in images)


async def test_a_bad_image_is_a_typed_error_and_the_worker_serves_on(pool):
    await pool.start(workers=1)
    good = image_for_tests(8, 8)
    undecodable = image_for_tests(8, 8, data=b"GIF89a-not-really")
    wrong_digest = ImageInput(b"\x00" * 32, good.data, 8, 8, good.grid)
    wrong_grid = ImageInput(good.digest, good.data, 8, 8, image_for_tests(16, 16).grid)
    for request_id, bad, why in (("r1", undecodable, "cannot be decoded"), ("r2", wrong_digest, "digest"),
                                 ("r3", wrong_grid, "not this encoder's plan")):
        with pytest.raises(VisionError, match=why) as failed:
            await pool.encode(request_id, [good, bad])
        assert failed.value.code == ErrorCode.INVALID_REQUEST and failed.value.index == 1
    (rows,) = await pool.encode("r4", [good])
    assert torch.equal(rows, expected_rows(good))
    assert sample(pool.workers[0], "epd_vision_failed_total") == 3


async def test_the_next_image_goes_to_the_worker_with_fewer_queued_patches(pool):
    await pool.start()
    w1, w2 = pool.workers
    gates = [pool.gate(w1), pool.gate(w2)]
    large = asyncio.create_task(pool.encode("large", [image_for_tests(16, 16)]))   # 64 patches: w1 (tie, name)
    await eventually(w1.encoder.entered.is_set, what="w1 encoding")
    smalls = [asyncio.create_task(pool.encode(f"small{i}", [image_for_tests(8, 8, salt=i)])) for i in range(3)]
    await eventually(lambda: len(pool.leader.core.jobs) == 4, what="jobs placed")
    holders = {job.request_id: job.worker for job in pool.leader.core.jobs.values()}
    assert holders == {"large": "lead-w1", "small0": "lead-w2", "small1": "lead-w2", "small2": "lead-w2"}
    for gate in gates:
        gate.set()
    await asyncio.gather(large, *smalls)


async def test_a_dead_worker_jobs_finish_on_another_worker(pool):
    await pool.start()
    w1, w2 = pool.workers
    pool.gate(w1)
    image = image_for_tests(16, 16)
    task = asyncio.create_task(pool.encode("r1", [image]))
    await eventually(w1.encoder.entered.is_set, what="w1 encoding")
    w1.stop()   # dies holding the job
    (rows,) = await task
    assert torch.equal(rows, expected_rows(image)) and w2.encoder.batches == [[image.grid.patches]]
    assert sample(pool.leader, "epd_vision_balancer_redispatched_total") == 1


async def test_with_no_worker_left_the_images_fail_with_a_typed_error(pool):
    await pool.start(workers=1)
    (w1,) = pool.workers
    pool.gate(w1)
    task = asyncio.create_task(pool.encode("r1", [image_for_tests(8, 8)]))
    await eventually(w1.encoder.entered.is_set, what="w1 encoding")
    w1.stop()
    with pytest.raises(VisionError) as failed:   # PEER_DEAD from the leader, then the retry finds no worker
        await task
    assert failed.value.code == ErrorCode.OVERLOADED and "no vision worker" in failed.value.message
    assert sample(pool.leader, "epd_vision_balancer_failed_total") == 1


async def test_a_draining_worker_loses_no_request(pool):
    await pool.start()
    w1, w2 = pool.workers
    w1.begin_drain()   # the leader still thinks it runs until its next heartbeat
    image = image_for_tests(8, 8)
    (rows,) = await pool.encode("r1", [image])
    assert torch.equal(rows, expected_rows(image))


async def test_a_cancel_drops_the_request_images_still_queued(pool):
    await pool.start(workers=1)
    (w1,) = pool.workers
    gate = pool.gate(w1)
    first = asyncio.create_task(pool.encode("first", [image_for_tests(8, 8)]))
    await eventually(w1.encoder.entered.is_set, what="w1 encoding")
    queued = asyncio.create_task(pool.encode("queued", [image_for_tests(8, 8, salt=1), image_for_tests(12, 12)]))
    await eventually(lambda: len(w1.queue) == 2, what="the second request queued")
    pool.client.vision.cancel("queued")
    with pytest.raises(VisionError) as cancelled:
        await queued
    assert cancelled.value.code == ErrorCode.ABORTED
    await eventually(lambda: len(pool.leader.core.jobs) == 1, what="the cancelled job reported done")
    assert sample(w1, "epd_vision_cancelled_total") == 2 and len(w1.queue) == 0
    gate.set()
    await first
    assert w1.encoder.batches == [[16]]


async def test_no_group_is_a_typed_error(pool):
    await pool.start(workers=1)
    with pytest.raises(VisionError) as failed:
        await pool.client.vision.encode("r1", [image_for_tests(8, 8)], [])
    assert failed.value.code == ErrorCode.OVERLOADED
    assert await pool.client.vision.encode("r2", [], []) == []


async def test_a_leader_registers_with_every_gateway_replica(tmp_path):
    services = InProcessServices(tmp_path)
    try:
        gateways = [await services.start(Service, f"gateway-{i}") for i in range(2)]
        await services.start(VisionBalancerService, "lead", upstream=gateways[0].config.advertise,
                             upstream_replicas=(gateways[1].config.advertise,))
        for gateway in gateways:   # each lists the leader the way image_calls.py looks for it
            await eventually(lambda: [p.instance for p in gateway.members.alive("vision_balancer")] == ["lead"],
                             what=f"the leader registered with {gateway.config.instance}")
    finally:
        await services.close()
