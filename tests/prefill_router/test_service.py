"""PrefillRouterService over real ZeroMQ, with the real SWA registry and decode router and test-only
helpers for the gateway, the KV writer, the prefill ranks and a decode worker: hit length, decode
choice, pull under headroom, dead ranks, aborts, overload."""
from __future__ import annotations

import pytest

from messages import ErrorReply
from messages.common import SamplingParams
from messages.control import Load
from messages.errors import ErrorCode
from messages.generate import AbortRequest, GenerateChunk, GenerateRequest
from messages.kv_store import KvLookup, KvLookupReply
from messages.routing import PrefillDone, PrefillWork
from messages.swa_registry import SwaRegister
from services.catalog import resolve
from services.decode_router.service import DecodeRouterService
from services.prefill_router.service import PrefillRouterService
from services.runtime.config import ServiceConfig
from services.runtime.service import Service
from services.swa_registry.service import SwaRegistryService
from tests.decode_router.test_service import Running, TestHelperDecodeWorker, eventually


@pytest.fixture
async def running(tmp_path):
    services = Running(tmp_path)
    yield services
    await services.close()


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


class TestHelperGateway(Service):
    """Test-only: sends GenerateRequest to its upstream (the router) and records what comes back."""

    kind = "gateway"
    __test__ = False

    def __init__(self, config):
        super().__init__(config)
        self.received: dict[str, list] = {}

    def handlers(self):
        return {GenerateChunk: self._record, ErrorReply: self._record}

    async def _record(self, msg, ctx) -> None:
        self.received.setdefault(ctx.request_id, []).append(msg)

    def generate(self, rid: str, prompt_len: int, blocks: int | None = None) -> None:
        blocks = prompt_len // 128 if blocks is None else blocks
        request = GenerateRequest("m", list(range(prompt_len)), SamplingParams(max_tokens=32),
                                  block_hashes=[h(i) for i in range(blocks)], return_address=self.config.advertise)
        self.send(self.config.upstream, request, request_id=rid)

    def abort(self, rid: str) -> None:
        self.send(self.config.upstream, AbortRequest("client"), request_id=rid)


class TestHelperKvWriter(Service):
    """Test-only: the KV writer's index: the longest stored prefix of the asked chain."""

    kind = "kv_writer"
    __test__ = False

    def __init__(self, config):
        super().__init__(config)
        self.stored: set[bytes] = set()
        self.asked: list[list[bytes]] = []

    def handlers(self):
        return {KvLookup: self._lookup}

    async def _lookup(self, msg: KvLookup, ctx) -> KvLookupReply:
        assert not msg.with_locations        # the router needs only the hit length
        self.asked.append(list(msg.block_hashes))
        hits = 0
        while hits < len(msg.block_hashes) and msg.block_hashes[hits] in self.stored:
            hits += 1
        return KvLookupReply(hits)


class TestHelperPrefillWorker(Service):
    """Test-only: a prefill rank. Answers PrefillWork at once (auto) or when released; reports the
    work it holds in its heartbeats."""

    kind = "prefill_worker"
    __test__ = False

    def __init__(self, config, auto: bool = True):
        super().__init__(config)
        self.auto = auto
        self.works: list[tuple[str, PrefillWork]] = []
        self.held: dict[str, tuple[PrefillWork, object]] = {}
        self.aborted: list[str] = []

    def handlers(self):
        return {PrefillWork: self._on_work, AbortRequest: self._on_abort}

    async def _on_work(self, msg: PrefillWork, ctx):
        self.works.append((ctx.request_id, msg))
        if self.auto:
            return PrefillDone(msg.hit_tokens, len(msg.request.prompt_ids) - msg.hit_tokens)
        self.held[ctx.request_id] = (msg, ctx)
        return None

    async def _on_abort(self, msg: AbortRequest, ctx) -> None:
        self.aborted.append(ctx.request_id)
        self.held.pop(ctx.request_id, None)

    def release(self, rid: str, error: ErrorReply | None = None) -> None:
        msg, ctx = self.held.pop(rid)
        ctx.reply(error or PrefillDone(msg.hit_tokens, len(msg.request.prompt_ids) - msg.hit_tokens))

    def load(self) -> Load:
        return Load(in_flight=len(self.held),
                    queued_tokens=sum(len(w.request.prompt_ids) - w.hit_tokens for w, _ in self.held.values()))


async def stack(running: Running, *, ranks: int = 1, auto: bool = True, decode: bool = True, **settings):
    kv = await running.start(TestHelperKvWriter, "kv")
    swa = await running.start(SwaRegistryService, "swa")
    decode_router = await running.start(DecodeRouterService, "dr")
    decoders = [await running.start(TestHelperDecodeWorker, "dw", upstream=decode_router.config.advertise)] \
        if decode else []
    router = await running.start(PrefillRouterService, "pr", settings={
        "kv_writer": kv.config.advertise, "swa_registry": swa.config.advertise,
        "decode_router": decode_router.config.advertise, **settings})
    workers = [await running.start(TestHelperPrefillWorker, f"pw{i}", upstream=router.config.advertise, auto=auto)
               for i in range(ranks)]
    gateway = await running.start(TestHelperGateway, "gw", upstream=router.config.advertise)
    await eventually(lambda: len(router.members.alive("prefill_worker")) == ranks
                     and len(router.members.alive("gateway")) == 1
                     and len(decode_router.members.alive("decode_worker")) == len(decoders), what="registered")
    return router, gateway, workers, kv, swa, decoders


def error_of(gateway: TestHelperGateway, rid: str) -> ErrorReply:
    [reply] = gateway.received[rid]
    assert isinstance(reply, ErrorReply)
    return reply


async def test_a_request_goes_out_with_its_hit_length_swa_holder_and_decode_instance(running):
    router, gateway, [worker], kv, swa, [decoder] = await stack(running)
    kv.stored = {h(i) for i in range(5)}                       # L1 = 5 blocks = 640
    client = await running.start(Service, "client")
    await client.call(swa.config.advertise, SwaRegister([h(4)], "tcp://holder:7"))   # window at 640
    gateway.generate("r1", 1000)                               # 7 hashes; cap 1000 - 134 -> 768
    await eventually(lambda: worker.works, what="work arrived")
    rid, work = worker.works[0]
    assert rid == "r1" and work.hit_tokens == 640 and work.swa_holder == "tcp://holder:7"
    assert work.decode_address == decoder.config.advertise
    assert work.request.prompt_ids == list(range(1000)) and work.request.return_address == gateway.config.advertise
    assert kv.asked == [[h(i) for i in range(6)]]              # only hashes below the cap are asked
    await eventually(lambda: router.core.outstanding() == 0, what="PrefillDone seen")
    assert router.core.stats.finished == 1 and "r1" not in gateway.received
    labels = {"kind": "prefill_router", "instance": "pr"}
    metric = router.metrics.registry.get_sample_value
    assert metric("epd_prefill_router_dispatched_total", labels) == 1
    assert sum(metric("epd_prefill_bucket_engines", {**labels, "bucket": str(b)}) for b in range(4)) == 1


async def test_the_lookup_asks_at_most_max_lookup_blocks(running):
    router, gateway, [worker], kv, *_ = await stack(running, max_lookup_blocks=3)
    kv.stored = {h(i) for i in range(10)}
    gateway.generate("r1", 2000)
    await eventually(lambda: worker.works, what="work arrived")
    assert kv.asked == [[h(0), h(1), h(2)]] and worker.works[0][1].hit_tokens == 256   # no SWA: 384 - 128


async def test_without_the_swa_window_the_hit_backs_off_one_block(running):
    router, gateway, [worker], kv, swa, _ = await stack(running)
    kv.stored = {h(i) for i in range(5)}
    gateway.generate("r1", 1000)
    gateway.generate("r2", 300, blocks=2)                      # tiny: cap 128, window missing -> 0
    await eventually(lambda: len(worker.works) == 2, what="work arrived")
    hits = {rid: (w.hit_tokens, w.swa_holder) for rid, w in worker.works}
    assert hits == {"r1": (512, ""), "r2": (0, "")}


async def test_backing_off_one_block_names_the_holder_of_the_window_there(running):
    router, gateway, [worker], kv, swa, _ = await stack(running)
    kv.stored = {h(i) for i in range(5)}                       # L1 = 640, its window missing
    client = await running.start(Service, "client")
    await client.call(swa.config.advertise, SwaRegister([h(3)], "tcp://holder:3"))   # window at 512
    gateway.generate("r1", 1000)
    await eventually(lambda: worker.works, what="work arrived")
    assert (worker.works[0][1].hit_tokens, worker.works[0][1].swa_holder) == (512, "tcp://holder:3")


async def test_no_headroom_keeps_requests_queued_until_a_rank_finishes(running):
    router, gateway, [worker], *_ = await stack(running, auto=False, rank_token_budget=1500)
    for i in range(4):
        gateway.generate(f"r{i}", 1000)
        await eventually(lambda: router.core.queued() + router.core.outstanding() == i + 1, what="routed")
    await eventually(lambda: len(worker.works) == 2, what="two dispatched")
    assert router.core.queued() == 2                           # 2000 tokens held >= budget 1500
    worker.release("r0")
    await eventually(lambda: len(worker.works) == 3, what="third dispatched")
    worker.release("r1")
    await eventually(lambda: len(worker.works) == 4, what="fourth dispatched")
    assert [rid for rid, _ in worker.works] == ["r0", "r1", "r2", "r3"]


async def test_a_dead_prefill_rank_fails_its_requests_with_peer_dead(running):
    router, gateway, [worker], *_ = await stack(running, auto=False)
    gateway.generate("r1", 1000)
    await eventually(lambda: worker.held, what="work held")
    await running.stop(worker)
    await eventually(lambda: "r1" in gateway.received, what="error at the gateway")
    assert error_of(gateway, "r1").code == ErrorCode.PEER_DEAD
    assert router.core.outstanding() == 0


async def test_a_rank_error_reaches_the_gateway(running):
    router, gateway, [worker], *_ = await stack(running, auto=False)
    gateway.generate("r1", 1000)
    await eventually(lambda: worker.held, what="work held")
    worker.release("r1", ErrorReply(int(ErrorCode.INVALID_REQUEST), "bad prompt"))
    await eventually(lambda: "r1" in gateway.received, what="error at the gateway")
    reply = error_of(gateway, "r1")
    assert reply.code == ErrorCode.INVALID_REQUEST and reply.message == "bad prompt"


async def test_no_decode_worker_fails_the_request_with_overloaded(running):
    router, gateway, [worker], *_ = await stack(running, decode=False)
    gateway.generate("r1", 1000)
    await eventually(lambda: "r1" in gateway.received, what="error at the gateway")
    assert error_of(gateway, "r1").code == ErrorCode.OVERLOADED
    assert worker.works == [] and router.core.outstanding() == 0


async def test_a_full_bucket_queue_is_overloaded(running):
    router, gateway, [worker], *_ = await stack(running, auto=False, rank_token_budget=1, queue_limit=1)
    for i in range(3):
        gateway.generate(f"r{i}", 1000)
    await eventually(lambda: "r2" in gateway.received, what="refusal at the gateway")
    assert error_of(gateway, "r2").code == ErrorCode.OVERLOADED
    assert [rid for rid, _ in worker.works] == ["r0"] and router.core.queued() == 1


async def test_aborts_reach_the_queue_the_rank_and_the_decode_worker(running):
    router, gateway, [worker], _, _, [decoder] = await stack(running, auto=False, rank_token_budget=1)
    gateway.generate("r0", 1000)
    gateway.generate("r1", 1000)
    await eventually(lambda: worker.held and router.core.queued() == 1, what="one held, one queued")
    gateway.abort("r1")                                        # waiting: just removed
    await eventually(lambda: router.core.queued() == 0, what="queued request removed")
    gateway.abort("r0")                                        # at the rank: forwarded to rank and decode
    await eventually(lambda: worker.aborted == ["r0"] and decoder.aborted == ["r0"], what="abort forwarded")
    assert router.core.outstanding() == 0 and worker.works[0][0] == "r0" and len(worker.works) == 1


async def test_an_abort_after_prefill_reaches_the_decode_worker(running):
    router, gateway, [worker], _, _, [decoder] = await stack(running)
    gateway.generate("r1", 1000)
    await eventually(lambda: router.core.stats.finished == 1, what="prefilled")
    gateway.abort("r1")
    await eventually(lambda: decoder.aborted == ["r1"], what="abort at decode")
    assert worker.aborted == []


async def test_invalid_requests_are_refused_and_the_router_keeps_serving(running):
    router, gateway, [worker], *_ = await stack(running)
    bad = GenerateRequest("m", [], SamplingParams(), return_address=gateway.config.advertise)
    gateway.send(router.config.advertise, bad, request_id="bad")
    await eventually(lambda: "bad" in gateway.received, what="refusal")
    assert error_of(gateway, "bad").code == ErrorCode.INVALID_REQUEST
    gateway.generate("ok", 200)
    await eventually(lambda: worker.works, what="served")


def test_the_catalog_knows_the_kind_and_bad_settings_are_refused(tmp_path):
    assert resolve("prefill_router") is PrefillRouterService
    for settings in ({"gamma": 1}, {"bucket_bounds": [10, 5]}, {"alpha": -1.0}, {"round_s": 0},
                     {"lookup_timeout_s": 0}, {"worker_kind": ""}):
        with pytest.raises(ValueError):
            PrefillRouterService(ServiceConfig(kind="prefill_router", instance="r",
                                               bind=f"ipc://{tmp_path}/r.sock", settings=settings))
