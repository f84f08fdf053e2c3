"""Test-only peers of a gateway serving images, in-process over real ZeroMQ: an upstream that records
each GenerateRequest with its image bytes put back from the frames (and answers none), and a vision
group leader that only registers (so the gateway sees a live vision group). Plus test images."""
from __future__ import annotations

import io

from messages.generate import AbortRequest, GenerateRequest
from messages.images import join_image_data
from services.gateway.image_calls import BALANCER_KIND
from services.runtime.service import Service


class TestHelperImageUpstream(Service):
    kind = "test_helper_image_upstream"
    __test__ = False
    model_id = "test-helper-model"   # what it names to the gateway, as a unified worker names its engine's

    def __init__(self, config):
        super().__init__(config)
        self.requests: dict[str, tuple[GenerateRequest, list]] = {}   # request id -> (message, images with bytes)
        self.aborted: list[str] = []

    def handlers(self):
        return {GenerateRequest: self._record, AbortRequest: self._abort}

    async def _record(self, msg: GenerateRequest, ctx) -> None:
        images = join_image_data(list(msg.images), ctx.envelope)
        self.requests[ctx.request_id] = (msg, [bytes(image.data) for image in images])

    async def _abort(self, msg, ctx) -> None:
        self.aborted.append(ctx.request_id)


class TestHelperIdleVisionLeader(Service):
    kind = BALANCER_KIND
    __test__ = False


def png_for_tests(width: int, height: int, shade: int = 0) -> bytes:
    from PIL import Image
    out = io.BytesIO()
    Image.new("RGB", (width, height), (shade, 255 - shade, 128)).save(out, "PNG")
    return out.getvalue()
