"""Test-only: the vision pool without a model. FakeVisionEncoderForTests has VisionEncoder's API
(sizing, hidden_size, preprocess, encode) on a tiny sizing; its rows are a function of the image's
digest, so a test can tell whose rows arrived. `gate`, when set, holds every encode until released
(a worker busy for as long as the test wants, without sleeping). VisionWorkerForTests runs it;
VisionClientHostForTests is a bare service holding a VisionClient (the prefill worker's part),
RowsReceiverForTests one that keeps what it receives, VisionPoolForTests a leader with its workers."""
from __future__ import annotations

import hashlib
import threading

import torch

from messages.images import ImageInput, VisionSizing, plan_image_grid
from messages.vision import VisionEncoded, VisionFailed
from services.runtime.service import Service
from services.vision_balancer.service import VisionBalancerService
from services.vision_worker.service import VisionWorkerService
from services.workers.vision_client import VisionClient
from tests.helpers.test_helper_async import eventually

# patch 2, fold 2: an 8x8 image is 4x4 patches and 2x2 tokens (+ newlines, start, end: 8 tokens)
SIZING_FOR_TESTS = VisionSizing(patch_size=2, downsample_ratio=2, max_image_tokens=256, min_pixels=16)
HIDDEN_FOR_TESTS = 8
MAGIC = b"IMG:"   # the fake encoder's "image format": anything else is undecodable


def image_for_tests(width: int, height: int, salt: int = 0, data: bytes | None = None) -> ImageInput:
    data = data if data is not None else MAGIC + f"{width}x{height}#{salt}".encode()
    return ImageInput(hashlib.sha256(data).digest(), data, width, height,
                      plan_image_grid(width, height, SIZING_FOR_TESTS))


def expected_rows(image: ImageInput, dtype=torch.float32) -> torch.Tensor:
    base = float(bytes(image.digest)[0])
    tokens = image.grid.tokens
    return (base + torch.arange(tokens * HIDDEN_FOR_TESTS, dtype=torch.float32)
            .reshape(tokens, HIDDEN_FOR_TESTS) / 64).to(dtype)


class FakeVisionEncoderForTests:
    def __init__(self, dtype=torch.float32):
        self.sizing = SIZING_FOR_TESTS
        self.hidden_size = HIDDEN_FOR_TESTS
        self.dtype = dtype
        self.gate: threading.Event | None = None
        self.batches: list[list[int]] = []   # patches of each image, per batch encoded
        self.entered = threading.Event()    # set when an encode starts (tests wait for a busy worker)

    def preprocess(self, image: ImageInput) -> torch.Tensor:
        """Patches filled with the digest's first byte: the rows encode() derives from them name the image."""
        if not bytes(image.data).startswith(MAGIC):
            raise ValueError("not an image the fake encoder can decode")
        p = self.sizing.patch_size
        return torch.full((image.grid.patches, 3, p, p), float(bytes(image.digest)[0]))

    def encode(self, patches: list[torch.Tensor], grids) -> list[torch.Tensor]:
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(30)
        self.batches.append([len(p) for p in patches])
        return [(float(p.flatten()[0]) + torch.arange(g.tokens * HIDDEN_FOR_TESTS, dtype=torch.float32)
                 .reshape(g.tokens, HIDDEN_FOR_TESTS) / 64).to(self.dtype) for p, g in zip(patches, grids)]


class VisionWorkerForTests(VisionWorkerService):
    def load_encoder(self):
        return FakeVisionEncoderForTests(getattr(torch, self.settings.dtype))


class VisionClientHostForTests(Service):
    kind = "vision_client_host"
    vision_timeout_s = 5.0

    def __init__(self, config):
        self.vision = VisionClient(self, timeout_s=self.vision_timeout_s, accept_timeout_s=2.0)
        super().__init__(config)

    def handlers(self):
        return self.vision.handlers()


class RowsReceiverForTests(Service):
    """Keeps every VisionEncoded / VisionFailed envelope it receives (a prefill worker's inbox, bare)."""

    kind = "rows_receiver"

    def __init__(self, config):
        self.answers: list = []
        super().__init__(config)

    def handlers(self):
        return {VisionEncoded: self._keep, VisionFailed: self._keep}

    async def _keep(self, msg, ctx) -> None:
        self.answers.append(ctx.envelope)


class VisionPoolForTests:
    """A leader, its workers (VisionWorkerForTests) and a client host, in this test's event loop."""

    def __init__(self, services):
        self.services = services
        self.workers: list[VisionWorkerForTests] = []
        self.client: VisionClientHostForTests | None = None

    async def start(self, workers: int = 2, dtype: str = "float32", policy: str = "patches", name: str = "lead",
                    client: VisionClientHostForTests | None = None):
        self.leader = await self.services.start(VisionBalancerService, name, settings={"policy": policy})
        for i in range(workers):
            self.workers.append(await self.services.start(
                VisionWorkerForTests, f"{name}-w{i + 1}", upstream=self.address,
                settings={"model_dir": "unused", "dtype": dtype, "warmup": False}))
        self.client = client or await self.services.start(VisionClientHostForTests, f"{name}-client")
        await eventually(lambda: len(self.leader.workers()) == workers, what="workers registered")
        return self

    @property
    def address(self) -> str:
        return self.leader.config.advertise

    def gate(self, worker) -> threading.Event:
        """Hold the worker's encodes until the event is set (close() sets it)."""
        gate = worker.encoder.gate = threading.Event()
        return gate

    async def encode(self, request_id: str, images: list[ImageInput], groups=None):
        return await self.client.vision.encode(request_id, images, groups or [self.address])

    async def close(self) -> None:
        for worker in self.workers:   # never leave an encoder thread waiting
            if worker.encoder is not None and worker.encoder.gate is not None:
                worker.encoder.gate.set()
        await self.services.close()
