"""VisionWorkerService alone: it warms its encoder before it runs; jobs sent to it directly (no
leader) are answered straight to reply_to; batches follow the patch budget; with the real V4.1
tower (tiny config) its rows are exactly VisionEncoder.encode's, float32 and bfloat16."""
from __future__ import annotations

import hashlib
import io

import numpy as np
import pytest
import torch
from PIL import Image

from messages.errors import RemoteError
from messages.images import ImageInput, VisionSizing, plan_image_grid
from messages.vision import VisionEncode, image_frames
from services.vision_balancer.service import VisionBalancerService
from services.vision_worker.service import VisionWorkerService
from services.workers.tensors import torch_frame
from tests.helpers.test_helper_async import eventually
from tests.helpers.test_helper_services import InProcessServices
from tests.helpers.test_helper_vision import (RowsReceiverForTests, VisionClientHostForTests, VisionWorkerForTests,
                                              expected_rows, image_for_tests)


@pytest.fixture
async def services(tmp_path):
    services = InProcessServices(tmp_path)
    yield services
    await services.close()


async def test_the_encoder_is_warmed_before_the_worker_runs(services):
    worker = await services.start(VisionWorkerForTests, "w", settings={"model_dir": "unused"})
    floor = plan_image_grid(2, 2, worker.encoder.sizing)
    assert worker.encoder.batches == [[floor.patches]]


async def test_a_job_without_a_leader_is_answered_straight_to_reply_to(services):
    worker = await services.start(VisionWorkerForTests, "w", settings={"model_dir": "unused", "warmup": False,
                                                                        "max_batch_patches": 40})
    receiver = await services.start(RowsReceiverForTests, "prefill")
    images = [image_for_tests(8, 8, salt=i) for i in range(3)]   # 16 patches each: at most 2 a batch
    bare, frames = image_frames(images)
    receiver.send(worker.config.advertise, VisionEncode(bare, receiver.config.advertise, indexes=[5, 6, 7]),
                  request_id="r1", buffers=frames)
    await eventually(lambda: len(receiver.answers) == 3, what="three answers")
    by_index = {env.message.index: env for env in receiver.answers}
    for index, image in zip((5, 6, 7), images):
        assert torch.equal(torch_frame(by_index[index], 0), expected_rows(image))
        assert by_index[index].request_id == "r1" and by_index[index].message.digest == image.digest
    assert sorted(len(batch) for batch in worker.encoder.batches) == [1, 2]
    await eventually(lambda: not worker.queue.jobs, what="the job ended")
    assert worker.queue.queued_patches == 0 and worker.load().queued_tokens == 0


def jpeg(width: int, height: int, seed: int, sizing: VisionSizing) -> ImageInput:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG")
    data = out.getvalue()
    return ImageInput(hashlib.sha256(data).digest(), data, width, height, plan_image_grid(width, height, sizing))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_rows_are_the_v41_towers_own(services, tiny_v41_model_dir, dtype):
    from engine.models.v41.vision import VisionEncoder
    reference = VisionEncoder.load(tiny_v41_model_dir, dtype=getattr(torch, dtype))
    images = [jpeg(200, 150, 1, reference.sizing), jpeg(500, 400, 2, reference.sizing)]
    leader = await services.start(VisionBalancerService, "lead")
    await services.start(VisionWorkerService, "w", upstream=leader.config.advertise,
                         settings={"model_dir": str(tiny_v41_model_dir), "dtype": dtype, "torch_threads": 1})
    client = await services.start(VisionClientHostForTests, "prefill")
    await eventually(lambda: leader.workers(), what="the worker registered")
    rows = await client.vision.encode("r1", images, [leader.config.advertise])
    expected = reference.encode([reference.preprocess(i) for i in images], [i.grid for i in images])
    for got, want, image in zip(rows, expected, images):
        assert got.dtype == getattr(torch, dtype) and got.shape == (image.grid.tokens, reference.hidden_size)
        assert torch.equal(got, want)


async def test_a_model_without_vision_starts_and_refuses_images(services, tmp_path):
    """A V4 model on the default topology: the stack still comes up; images sent here are refused."""
    from engine.models.v4.random_init import write_random_model_dir
    model_dir = write_random_model_dir("tiny", tmp_path / "v4", seed=0, vocab_size=1024)
    worker = await services.start(VisionWorkerService, "w", settings={"model_dir": str(model_dir)})
    assert worker.encoder is None and "no vision encoder" in worker.no_encoder
    receiver = await services.start(RowsReceiverForTests, "prefill")
    bare, frames = image_frames([image_for_tests(8, 8)])
    with pytest.raises(RemoteError, match="cannot encode images"):
        await receiver.call(worker.config.advertise, VisionEncode(bare, receiver.config.advertise),
                            request_id="r1", buffers=frames)
