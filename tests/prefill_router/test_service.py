"""PrefillRouterService over real ZeroMQ, with a real KV store directory and a real decode router, and
test-only helpers for the gateway, the prefill ranks and the decode workers: the hit read from the
store (capped), the decode worker chosen from the decode router's table, waiting (not refusing)
while a decode worker or a rank has no room, the queue deadline, overload, aborts, dead ranks."""
from __future__ import annotations

import pytest

from kvstore import SegmentStore, StoreSettings
from messages import ErrorReply
from messages.common import SamplingParams
from messages.control import Load
from messages.errors import ErrorCode
from messages.generate import AbortRequest, GenerateChunk, GenerateRequest
from messages.routing import PrefillDone, PrefillWork
from services.catalog import resolve
from services.decode_router.service import DecodeRouterService
from services.prefill_router.service import PrefillRouterService
from services.runtime.config import ServiceConfig
from services.runtime.service import Service
from tests.decode_router.test_service import Running, TestHelperDecodeWorker, eventually
from tests.kvstore.common import pages_of


@pytest.fixture
async def running(tmp_path):
    services = Running(tmp_path)
    yield services
    await services.close()


@pytest.fixture
def kv_store(tmp_path):
    """The KV writer's side of a store directory: the router reads the same directory."""
    with SegmentStore(StoreSettings(root=str(tmp_path / "kvstore"))) as store:
        yield store


def h(i: int) -> bytes:
    return (i + 1).to_bytes(16, "big")


def store_blocks(store: SegmentStore, *indices: int) -> None:
    store.write(pages_of([h(i) for i in indices]))


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
            return self._done(msg)
        self.held[ctx.request_id] = (msg, ctx)
        return None

    async def _on_abort(self, msg: AbortRequest, ctx) -> None:
        self.aborted.append(ctx.request_id)
        self.held.pop(ctx.request_id, None)

    def release(self, rid: str, error: ErrorReply | None = None) -> None:
        msg, ctx = self.held.pop(rid)
        ctx.reply(error or self._done(msg))

    @staticmethod
    def _done(msg: PrefillWork) -> PrefillDone:
        return PrefillDone(msg.kv_hit_tokens, len(msg.request.prompt_ids) - msg.kv_hit_tokens)

    def rids(self) -> list[str]:
        return [rid for rid, _ in self.works]

    def load(self) -> Load:
        return Load(in_flight=len(self.held),
                    queued_tokens=sum(len(w.request.prompt_ids) - w.kv_hit_tokens for w, _ in self.held.values()))


class Stack:
    def __init__(self, router, gateway, workers, decode_router, decoders):
        self.router: PrefillRouterService = router
        self.gateway: TestHelperGateway = gateway
        self.workers: list[TestHelperPrefillWorker] = workers
        self.decode_router: DecodeRouterService = decode_router
        self.decoders: list[TestHelperDecodeWorker] = decoders

    @property
    def worker(self) -> TestHelperPrefillWorker:
        return self.workers[0]

    async def tables_seen(self, count: int = 2) -> None:
        """Wait until the router has fetched (and pumped after) at least count - 1 more tables."""
        start = self.decode_router.tables_sent
        await eventually(lambda: self.decode_router.tables_sent >= start + count, what="tables fetched")

    def error_of(self, rid: str) -> ErrorReply:
        [reply] = self.gateway.received[rid]
        assert isinstance(reply, ErrorReply)
        return reply


async def stack(running: Running, store: SegmentStore | None, *, ranks: int = 1, auto: bool = True,
                decoders: tuple[Load, ...] = (Load(),), **settings) -> Stack:
    decode_router = await running.start(DecodeRouterService, "dr")
    decode_workers = [await running.start(TestHelperDecodeWorker, f"dw{i}", upstream=decode_router.config.advertise,
                                          load=load) for i, load in enumerate(decoders)]
    router = await running.start(PrefillRouterService, "pr", settings={
        "kv_store_dir": store.root if store is not None else "", "decode_router": decode_router.config.advertise,
        "decode_table_interval_s": 0.05, **settings})
    workers = [await running.start(TestHelperPrefillWorker, f"pw{i}", upstream=router.config.advertise, auto=auto)
               for i in range(ranks)]
    gateway = await running.start(TestHelperGateway, "gw", upstream=router.config.advertise)
    await eventually(lambda: len(router.members.alive("prefill_worker")) == ranks
                     and len(router.members.alive("gateway")) == 1
                     and (not router.settings.decode_router or router.decode.fresh())
                     and router.decode.workers() == (len(decoders) if router.settings.decode_router else 0),
                     what="registered, decode table fetched")
    return Stack(router, gateway, workers, decode_router, decode_workers)


async def test_a_request_goes_out_with_the_stores_hit_and_the_best_decode_worker(running, kv_store):
    store_blocks(kv_store, 0, 1, 2, 3, 4)                      # L1 = 5 blocks = 640
    s = await stack(running, kv_store, decoders=(Load(batch_size=4, kv_usage=0.9), Load(batch_size=4, kv_usage=0.1)))
    s.gateway.generate("r1", 1000)                             # 7 hashes; cap 1000 - 134 -> 768
    await eventually(lambda: s.worker.works, what="work arrived")
    rid, work = s.worker.works[0]
    assert rid == "r1" and work.kv_hit_tokens == 640
    assert work.decode_address == s.decoders[1].config.advertise   # kv 0.1 beats kv 0.9 at equal batch
    assert work.request.prompt_ids == list(range(1000)) and work.request.return_address == s.gateway.config.advertise
    await eventually(lambda: s.router.core.outstanding() == 0, what="PrefillDone seen")
    assert s.router.core.stats.finished == 1 and "r1" not in s.gateway.received
    # the reservation ends once a decode heartbeat sent after the hand-off is in the table
    await eventually(lambda: s.router.decode.held() == 0, what="reservation settled")
    labels = {"kind": "prefill_router", "instance": "pr"}
    metric = s.router.metrics.registry.get_sample_value
    assert metric("epd_prefill_router_dispatched_total", labels) == 1
    assert sum(metric("epd_prefill_bucket_engines", {**labels, "bucket": str(b)}) for b in range(4)) == 1


async def test_the_hit_is_the_stored_prefix_capped_at_L_minus_134(running, kv_store):
    store_blocks(kv_store, *range(7))                          # 896 tokens stored
    s = await stack(running, kv_store)
    s.gateway.generate("whole", 1000)                          # cap 768 < 896
    s.gateway.generate("small", 300, blocks=2)                 # cap (300 - 134) -> 128
    s.gateway.generate("tiny", 200, blocks=1)                  # cap 0: nothing to load
    s.gateway.generate("exact", 1158)                          # cap 1024: the whole 896 stored
    await eventually(lambda: len(s.worker.works) == 4, what="work arrived")
    assert {rid: w.kv_hit_tokens for rid, w in s.worker.works} == {"whole": 768, "small": 128, "tiny": 0,
                                                                   "exact": 896}


async def test_the_hit_stops_at_the_first_block_the_store_lacks(running, kv_store):
    store_blocks(kv_store, 0, 1, 3, 4)
    s = await stack(running, kv_store)
    s.gateway.generate("gap", 1000)
    await eventually(lambda: s.worker.works, what="work arrived")
    assert s.worker.works[0][1].kv_hit_tokens == 256


async def test_the_lookup_reads_at_most_max_lookup_blocks(running, kv_store):
    store_blocks(kv_store, *range(10))
    s = await stack(running, kv_store, max_lookup_blocks=3)
    s.gateway.generate("r1", 2000)                             # cap 1792, 10 blocks stored
    await eventually(lambda: s.worker.works, what="work arrived")
    assert s.worker.works[0][1].kv_hit_tokens == 384


async def test_without_a_store_or_a_decode_stage_work_goes_out_plain(running):
    s = await stack(running, None, decoders=(), decode_router="")
    s.gateway.generate("r1", 1000)
    await eventually(lambda: s.worker.works, what="work arrived")
    work = s.worker.works[0][1]
    assert (work.kv_hit_tokens, work.decode_address) == (0, "")
    assert s.router.decode.held() == 0


async def test_held_reservations_spread_a_burst_over_the_decode_workers(running, kv_store):
    s = await stack(running, kv_store, auto=False, decoders=(Load(), Load()))
    for i in range(4):
        s.gateway.generate(f"r{i}", 1000)
    await eventually(lambda: len(s.worker.works) == 4, what="work arrived")
    a, b = (d.config.advertise for d in s.decoders)
    assert [w.decode_address for _, w in s.worker.works] == [a, b, a, b]
    assert s.router.decode.pending() == {"dw0": 2, "dw1": 2}


async def test_requests_wait_while_no_decode_worker_has_room(running, kv_store):
    s = await stack(running, kv_store, auto=False, decoders=(Load(batch_size=2, capacity=2),))
    [decoder] = s.decoders
    s.gateway.generate("r1", 1000)
    s.gateway.generate("r2", 1000)
    await eventually(lambda: s.router.core.queued() == 2, what="both queued")
    await s.tables_seen()
    assert s.router.core.queued() == 2 and s.worker.works == [] and s.gateway.received == {}
    decoder.fixed_load = Load(batch_size=1, capacity=2)        # room for one
    await eventually(lambda: s.worker.works, what="first out")
    assert s.worker.rids() == ["r1"] and s.worker.works[0][1].decode_address == decoder.config.advertise
    await s.tables_seen()
    assert s.router.core.queued() == 1                         # r1's reservation fills the worker
    s.worker.release("r1")                                     # handed off; the decoder's next heartbeat
    await eventually(lambda: len(s.worker.works) == 2, what="second out")   # ... frees the slot
    assert s.worker.rids() == ["r1", "r2"] and s.gateway.received == {}


async def test_requests_wait_for_a_decode_worker_to_register(running, kv_store):
    s = await stack(running, kv_store, decoders=())
    s.gateway.generate("r1", 1000)
    await eventually(lambda: s.router.core.queued() == 1, what="queued")
    await s.tables_seen()
    assert s.router.core.queued() == 1 and s.worker.works == [] and s.gateway.received == {}
    late = await running.start(TestHelperDecodeWorker, "late", upstream=s.decode_router.config.advertise)
    await eventually(lambda: s.worker.works, what="work arrived")
    assert s.worker.works[0][1].decode_address == late.config.advertise


async def test_no_rank_headroom_keeps_requests_queued_until_a_rank_finishes(running, kv_store):
    s = await stack(running, kv_store, auto=False, rank_token_budget=1500)
    for i in range(4):
        s.gateway.generate(f"r{i}", 1000)
        await eventually(lambda: s.router.core.queued() + s.router.core.outstanding() == i + 1, what="routed")
    await eventually(lambda: len(s.worker.works) == 2, what="two dispatched")
    assert s.router.core.queued() == 2                         # 2000 tokens held >= budget 1500
    s.worker.release("r0")
    await eventually(lambda: len(s.worker.works) == 3, what="third dispatched")
    s.worker.release("r1")
    await eventually(lambda: len(s.worker.works) == 4, what="fourth dispatched")
    assert s.worker.rids() == ["r0", "r1", "r2", "r3"] and s.gateway.received == {}


async def test_the_queue_deadline_fails_waiting_requests_with_overloaded(running, kv_store):
    s = await stack(running, kv_store, decoders=(), max_queue_wait_s=0.3)
    s.gateway.generate("r1", 1000)
    await eventually(lambda: "r1" in s.gateway.received, what="error at the gateway")
    assert s.error_of("r1").code == ErrorCode.OVERLOADED
    assert s.worker.works == [] and s.router.core.queued() == 0 and s.router.core.stats.expired == 1


async def test_a_stale_decode_table_holds_requests_back(running, kv_store):
    s = await stack(running, kv_store, decode_table_stale_s=0.3, max_queue_wait_s=1.0)
    await running.stop(s.decode_router)
    await eventually(lambda: not s.router.decode.fresh(), what="table stale")
    s.gateway.generate("r1", 1000)                             # the decode worker may be gone: wait
    await eventually(lambda: "r1" in s.gateway.received, what="error at the gateway")
    assert s.error_of("r1").code == ErrorCode.OVERLOADED and s.worker.works == []


async def test_a_full_bucket_queue_is_overloaded(running, kv_store):
    s = await stack(running, kv_store, decoders=(), queue_limit=1)
    s.gateway.generate("r0", 1000)
    s.gateway.generate("r1", 1000)
    await eventually(lambda: "r1" in s.gateway.received, what="refusal at the gateway")
    assert s.error_of("r1").code == ErrorCode.OVERLOADED
    assert "r0" not in s.gateway.received and s.router.core.queued() == 1 and s.router.core.stats.refused == 1


async def test_aborts_remove_a_queued_request_and_reach_the_rank_of_an_outstanding_one(running, kv_store):
    s = await stack(running, kv_store, auto=False, rank_token_budget=1)
    s.gateway.generate("r0", 1000)
    s.gateway.generate("r1", 1000)
    await eventually(lambda: s.worker.held and s.router.core.queued() == 1, what="one held, one queued")
    assert s.router.decode.held() == 1                         # only the dispatched one holds a decode slot
    s.gateway.abort("r1")                                      # waiting: just removed
    await eventually(lambda: s.router.core.queued() == 0, what="queued request removed")
    s.gateway.abort("r0")                                      # at the rank: forwarded there only
    await eventually(lambda: s.worker.aborted == ["r0"], what="abort at the rank")
    assert s.router.core.outstanding() == 0 and s.router.decode.held() == 0
    assert s.worker.rids() == ["r0"] and s.decoders[0].aborted == [] and s.gateway.received == {}


async def test_an_abort_after_prefill_is_not_forwarded(running, kv_store):
    s = await stack(running, kv_store)
    s.gateway.generate("r1", 1000)
    await eventually(lambda: s.router.core.stats.finished == 1, what="prefilled")
    s.gateway.abort("r1")                                      # the gateway aborts at decode itself
    s.gateway.generate("r2", 1000)                             # sent after the abort on the same link
    await eventually(lambda: len(s.worker.works) == 2, what="next request served")
    assert s.worker.aborted == [] and s.decoders[0].aborted == []


async def test_a_dead_prefill_rank_fails_its_requests_with_peer_dead(running, kv_store):
    s = await stack(running, kv_store, auto=False)
    s.gateway.generate("r1", 1000)
    await eventually(lambda: s.worker.held, what="work held")
    await running.stop(s.worker)
    await eventually(lambda: "r1" in s.gateway.received, what="error at the gateway")
    assert s.error_of("r1").code == ErrorCode.PEER_DEAD
    assert s.router.core.outstanding() == 0 and s.router.decode.held() == 0


async def test_a_rank_error_reaches_the_gateway_and_frees_the_decode_slot(running, kv_store):
    s = await stack(running, kv_store, auto=False)
    s.gateway.generate("r1", 1000)
    await eventually(lambda: s.worker.held, what="work held")
    assert s.router.decode.held() == 1
    s.worker.release("r1", ErrorReply(int(ErrorCode.INVALID_REQUEST), "bad prompt"))
    await eventually(lambda: "r1" in s.gateway.received, what="error at the gateway")
    reply = s.error_of("r1")
    assert reply.code == ErrorCode.INVALID_REQUEST and reply.message == "bad prompt"
    assert s.router.decode.held() == 0


async def test_a_dead_gateways_requests_are_dropped_and_aborted(running, kv_store):
    s = await stack(running, kv_store, auto=False, rank_token_budget=1)
    s.gateway.generate("r0", 1000)
    s.gateway.generate("r1", 1000)
    await eventually(lambda: s.worker.held and s.router.core.queued() == 1, what="one held, one queued")
    await running.stop(s.gateway)
    await eventually(lambda: s.worker.aborted == ["r0"], what="running request aborted")
    assert s.router.core.queued() == 0 and s.router.core.outstanding() == 0 and s.router.decode.held() == 0


async def test_invalid_requests_are_refused_and_the_router_keeps_serving(running, kv_store):
    s = await stack(running, kv_store)
    bad = GenerateRequest("m", [], SamplingParams(), return_address=s.gateway.config.advertise)
    s.gateway.send(s.router.config.advertise, bad, request_id="bad")
    await eventually(lambda: "bad" in s.gateway.received, what="refusal")
    assert s.error_of("bad").code == ErrorCode.INVALID_REQUEST
    s.gateway.generate("ok", 200)
    await eventually(lambda: s.worker.works, what="served")


def test_the_catalog_knows_the_kind():
    assert resolve("prefill_router") is PrefillRouterService


@pytest.mark.parametrize("settings, named", [
    ({"gamma": 1}, "gamma"),
    ({"kv_writer": "tcp://kv:1"}, "kv_writer"),                # retired: the hit is read in-process
    ({"swa_registry": "tcp://swa:1"}, "swa_registry"),         # retired: the worker settles the window
    ({"route_memory": 100}, "route_memory"),                   # retired: aborts after prefill go to decode
    ({"lookup_timeout_s": 1.0}, "lookup_timeout_s"),
    ({"bucket_bounds": [10, 5]}, "bucket bounds"),
    ({"alpha": -1.0}, "alpha"),
    ({"round_s": 0}, "round_s"),
    ({"worker_kind": ""}, "worker_kind"),
    ({"max_lookup_blocks": 0}, "max_lookup_blocks"),
    ({"decode_table_stale_s": 0}, "decode_table_stale_s"),
    ({"pump_interval_s": "fast"}, "pump_interval_s"),
])
def test_bad_settings_are_refused_naming_the_service_and_the_key(tmp_path, settings, named):
    with pytest.raises(ValueError) as err:
        PrefillRouterService(ServiceConfig(kind="prefill_router", instance="r",
                                           bind=f"ipc://{tmp_path}/r.sock", settings=settings))
    assert "prefill_router" in str(err.value) and named in str(err.value)
