"""The real-process part of `epd bench vision`: the trace driven through the prefill side's
VisionClient into a leader and N vision worker processes per policy.

Each policy has its own pool (same model, same settings: only the leader's policy differs), and
each gets the same requests at the same arrival times (open loop: a request is sent at its time
whatever the pool's backlog). The trace runs in rounds, a slice each, every pool in turn with the
order rotating, so a busy spell of a shared host falls on every policy alike. The rate is set once
from a calibration on the first pool (a burst of requests: the patches the pool encodes a second),
so `load` x that capacity is offered. Latency = VisionClient.encode's return - its call: queueing
at the cards, preprocessing, encoding and the rows' transfer.
"""
from __future__ import annotations

import asyncio
import hashlib
import io
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from messages.control import ServiceState
from messages.images import ImageInput
from bench.vision.servers import VisionPoolProcesses
from bench.vision.trace import TraceRequest
from ops.ports import free_port_base
from services.runtime.config import ServiceConfig
from services.runtime.service import Service
from services.workers.vision_client import VisionClient


class VisionBenchClient(Service):
    """The prefill worker's part, alone: a service holding a VisionClient."""

    kind = "vision_bench_client"

    def __init__(self, config: ServiceConfig):
        self.vision = VisionClient(self, timeout_s=float(config.settings.get("timeout_s", 120.0)))
        super().__init__(config)

    def handlers(self):
        return self.vision.handlers()


@dataclass(slots=True)
class Window:
    policy: str
    latencies_s: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0


def encoded_image(width: int, height: int, rng: random.Random, sizing) -> ImageInput:
    """A JPEG of smooth random colour (a photo's cost to decode, not a flat image's)."""
    import numpy as np
    from PIL import Image
    from messages.images import plan_image_grid
    coarse = np.random.default_rng(rng.getrandbits(32)).integers(0, 256, (height // 16 + 2, width // 16 + 2, 3),
                                                                   dtype=np.uint8)
    picture = Image.fromarray(coarse).resize((width, height), Image.BILINEAR)
    out = io.BytesIO()
    picture.save(out, "JPEG", quality=90)
    data = out.getvalue()
    return ImageInput(hashlib.sha256(data).digest(), data, width, height, plan_image_grid(width, height, sizing))


def trace_images(trace: list[TraceRequest], sizing, seed: int) -> list[list[ImageInput]]:
    rng = random.Random(seed)
    return [[encoded_image(i.width, i.height, rng, sizing) for i in request.images] for request in trace]


async def start_client() -> tuple[VisionBenchClient, asyncio.Task]:
    port = free_port_base(1)
    client = VisionBenchClient(ServiceConfig(kind=VisionBenchClient.kind, instance="bench-vision-client",
                                             bind=f"tcp://127.0.0.1:{port}"))
    task = asyncio.get_running_loop().create_task(client.run(install_signals=False))
    while client.state == ServiceState.STARTING and not task.done():
        await asyncio.sleep(0.01)
    if task.done():
        raise RuntimeError(f"the bench client did not start: {client.failure}")
    return client, task


async def calibrate(client: VisionBenchClient, leader: str, requests: list[list[ImageInput]]) -> float:
    """Seconds a patch costs the whole pool: the requests sent at once, their patches over the wall
    time until the last is back (the workers share the host's cores and batch as under load)."""
    started = time.perf_counter()
    await asyncio.gather(*(client.vision.encode(f"calibrate-{n}", images, [leader])
                           for n, images in enumerate(requests)))
    return (time.perf_counter() - started) / sum(i.grid.patches for images in requests for i in images)


async def run_window(client: VisionBenchClient, leader: str, trace: list[TraceRequest],
                     images: list[list[ImageInput]], scale: float, window: Window, tag: str) -> None:
    """The requests at their arrival times (from the first one's), open loop; latencies into `window`."""
    loop = asyncio.get_running_loop()
    began, origin = loop.time(), trace[0].arrival_s

    async def one(number: int, request: TraceRequest) -> None:
        await asyncio.sleep(max(0.0, began + (request.arrival_s - origin) * scale - loop.time()))
        started = time.perf_counter()
        try:
            await client.vision.encode(f"{tag}-{number}", images[number], [leader])
        except Exception as exc:   # noqa: BLE001 - counted and reported; the window goes on
            name = getattr(getattr(exc, "code", None), "name", type(exc).__name__)
            window.errors[name] = window.errors.get(name, 0) + 1
            return
        window.latencies_s.append(time.perf_counter() - started)

    await asyncio.gather(*(one(n, r) for n, r in enumerate(trace)))
    window.wall_s += loop.time() - began


async def run_real(trace: list[TraceRequest], images: list[list[ImageInput]], policies: list[str],
                   workers: int, worker_settings: dict, load: float, logdir: Path, seed: int,
                   warm_requests: list[list[ImageInput]], rounds: int = 1, worker_kind: str = "vision_worker",
                   devices: list[str] | None = None, log=print) -> dict:
    """Every policy's pool started, warmed; the rate calibrated on the first; then `rounds` rounds,
    each a slice of the trace run on every pool in turn (the order rotating), so a busy spell of
    the host falls on every policy alike."""
    client, task = await start_client()
    pools: dict[str, VisionPoolProcesses] = {}
    windows = {policy: Window(policy) for policy in policies}
    try:
        for policy in policies:   # one at a time: each picks its free ports as it starts
            pools[policy] = VisionPoolProcesses(logdir, policy, workers, worker_settings, seed=seed,
                                                worker_kind=worker_kind, devices=devices)
            await asyncio.to_thread(pools[policy].__enter__)
            for n, warm in enumerate(warm_requests):   # every path warm before timing
                await client.vision.encode(f"warm-{policy}-{n}", warm, [pools[policy].address])
        s_per_patch = await calibrate(client, pools[policies[0]].address, warm_requests)
        mean_patches = sum(r.patches for r in trace) / len(trace)
        rate = load / (s_per_patch * mean_patches)
        log(f"calibration: the pool encodes a patch every {s_per_patch * 1e6:.1f} us; offered {rate:.2f} "
            f"requests/s ({load:.0%} of it), {rounds} round(s)")
        size = -(-len(trace) // rounds)
        for r in range(rounds):
            part = slice(r * size, (r + 1) * size)
            if not trace[part]:
                break
            for policy in policies[r % len(policies):] + policies[:r % len(policies)]:
                await run_window(client, pools[policy].address, trace[part], images[part], 1.0 / rate,
                                 windows[policy], tag=f"{policy}-{r}")
    finally:
        for pool in pools.values():
            await asyncio.to_thread(pool.stop)
        client.stop()
        await task
    return {"s_per_patch": s_per_patch, "rate": rate, "windows": list(windows.values())}
