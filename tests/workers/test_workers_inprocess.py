"""Prefill and decode workers in-process over real ZeroMQ, with a real KV writer and SWA registry:
the hand-off continues exactly like a unified engine, the decode worker persists prompt and generated
blocks and advertises its boundary states, and a second prefill worker loads a prefix from the store
(StoreReader or KvReadPages) plus the window state from its holder (one SwaFetch through the SWA
registry) and reports it as hit; without the window at L1 it takes L1 - 128, without either 0."""
from __future__ import annotations

import asyncio

import pytest

from engine.engine_core import EngineConfig, EngineCore, EngineRequest
from messages.common import FinishReason
from messages.errors import ErrorCode, RemoteError
from messages.generate import AbortRequest, GenerateChunk, GenerateRequest
from messages.handoff import KVSnapshot, StateHandoff
from messages.routing import PrefillDone, PrefillWork
from messages.prefix import block_hashes
from messages.swa_registry import SwaLookup, SwaUnregister
from services.gateway.open_requests import OpenRequest
from services.kv_writer.service import KvWriterService
from services.runtime.service import Service
from services.swa_registry.service import SwaRegistryService
from services.workers.decode import DecodeWorker
from services.workers.prefill import PrefillWorker
from tests.engine.references import greedy_params, make_prompt, run_engine
from tests.helpers.test_helper_async import eventually
from tests.helpers.test_helper_services import InProcessServices

def engine_settings(model_dir) -> dict:
    return {"model_dir": str(model_dir), "dtype": "float32", "num_pages": 64, "max_num_seqs": 8,
            "max_batched_tokens": 512}


class TestHelperGateway(Service):
    """Test-only: plays gateway (receives GenerateChunk, each token once as the real gateway takes
    it: OpenRequest.take) and prefill router (sends PrefillWork). `received` keeps every chunk as
    it came."""

    kind = "test_gateway"
    __test__ = False

    def __init__(self, config):
        super().__init__(config)
        self.chunks: dict[str, list[GenerateChunk]] = {}
        self.received: dict[str, list[GenerateChunk]] = {}
        self.open: dict[str, OpenRequest] = {}

    def handlers(self):
        return {GenerateChunk: self._on_chunk}

    async def _on_chunk(self, msg: GenerateChunk, ctx) -> None:
        self.received.setdefault(ctx.request_id, []).append(msg)
        request = self.open.setdefault(ctx.request_id, OpenRequest(ctx.request_id, ctx.span))
        new = request.take(msg)
        if new is not None:
            self.chunks.setdefault(ctx.request_id, []).append(new)

    def finished(self, rid: str) -> bool:
        chunks = self.chunks.get(rid, [])
        return bool(chunks) and chunks[-1].finish_reason != int(FinishReason.NONE)

    def tokens(self, rid: str) -> list[int]:
        return [t for c in self.chunks[rid] for t in c.token_ids]


class Stack(InProcessServices):
    def __init__(self, tmp_path, model_dir):
        super().__init__(tmp_path)
        self.model_dir = model_dir


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """A unified engine: what a prompt should produce."""
    engine = EngineCore(EngineConfig(**engine_settings(tiny_model_dir)))

    def collect(prompt: list[int], sampling):
        engine.add_request(EngineRequest("ref", prompt, sampling))
        return run_engine(engine)["ref"]

    def run(prompt: list[int], max_tokens: int) -> list[int]:
        return collect(prompt, greedy_params(max_tokens)).tokens
    run.model_id, run.collect = engine.model_id, collect
    return run


@pytest.fixture
async def stack(tmp_path, tiny_model_dir):
    s = Stack(tmp_path, tiny_model_dir)
    s.kv = await s.start(KvWriterService, "kv", {"root": str(tmp_path / "kvstore")})
    s.swa = await s.start(SwaRegistryService, "swa")
    peers = {"kv_writer": s.kv.config.advertise, "swa_registry": s.swa.config.advertise}
    s.gw = await s.start(TestHelperGateway, "gw")
    s.decode = await s.start(DecodeWorker, "decode", {**engine_settings(tiny_model_dir), **peers})
    s.prefill_a = await s.start(PrefillWorker, "prefill-a", {**engine_settings(tiny_model_dir), **peers,
                                                             "kv_store_dir": str(tmp_path / "kvstore")})
    s.prefill_b = await s.start(PrefillWorker, "prefill-b", {**engine_settings(tiny_model_dir), **peers,
                                                             "kv_store_dir": str(tmp_path / "kvstore")})
    s.prefill_c = await s.start(PrefillWorker, "prefill-c", {**engine_settings(tiny_model_dir), **peers})  # KvReadPages
    yield s
    await s.close()


async def generate(s: Stack, prefill: Service, rid: str, prompt: list[int], max_tokens: int, *,
                   hit: int = 0) -> tuple[PrefillDone, list[int], GenerateChunk]:
    request = GenerateRequest(model="tiny", prompt_ids=prompt, sampling=greedy_params(max_tokens),
                              block_hashes=block_hashes(s.decode.model_id, prompt),
                              return_address=s.gw.config.advertise)
    work = PrefillWork(request, hit, s.decode.config.advertise)
    done = (await s.gw.call(prefill.config.advertise, work, request_id=rid, timeout=120)).message
    await eventually(lambda: s.gw.finished(rid), timeout=120, what=f"{rid} finished")
    return done, s.gw.tokens(rid), s.gw.chunks[rid][-1]


async def engine_empty(worker) -> None:
    """Wait until the worker's engine holds no request (aborts run on the engine thread, later)."""
    for _ in range(500):
        if await worker.engine(lambda engine: engine.request_ids()) == []:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{worker.config.instance}: the engine still holds requests")


async def holder_of(s: Stack, block_hash: bytes) -> str:
    reply = (await s.gw.call(s.swa.config.advertise, SwaLookup([block_hash]))).message
    return reply.holders[0]


async def test_hand_off_then_prefix_from_store_and_holders(stack, reference):
    s = stack
    prompt = make_prompt(300, 1).tolist()
    done, tokens, last = await generate(s, s.prefill_a, "r1", prompt, 100)
    assert tokens == reference(prompt, 100)                       # prefill A's first token + decode's 99
    assert (done.hit_tokens, done.computed_tokens) == (0, 300)
    assert last.finish_reason == int(FinishReason.LENGTH)
    assert (last.usage.prompt_tokens, last.usage.cached_tokens, last.usage.completion_tokens) == (300, 0, 100)

    # the decode worker wrote the prompt's blocks and the generated one (tokens 256..383: 300 + 99 fed)
    full = prompt + tokens
    hashes = block_hashes(s.decode.model_id, full)
    await eventually(lambda: s.kv.store.lookup(hashes) == 3, timeout=10, what="three blocks persisted")
    # window states: prefill A holds those at 128 and 256 (it computed them), decode the one at 384
    await eventually(lambda: s.decode.persister.states_registered >= 1 and s.prefill_a.persister.states_registered >= 2,
                     timeout=10, what="states registered")
    assert await holder_of(s, hashes[0]) == s.prefill_a.config.advertise
    assert await holder_of(s, hashes[1]) == s.prefill_a.config.advertise
    assert await holder_of(s, hashes[2]) == s.decode.config.advertise

    # prefill B has nothing cached: pages from the store files, the window at 256 from prefill A
    # (140 new tokens: the L - 134 cap leaves the hit at 256)
    second = prompt[:256] + make_prompt(140, 2).tolist()
    done, tokens, last = await generate(s, s.prefill_b, "r2", second, 20, hit=256)
    assert (done.hit_tokens, done.computed_tokens) == (256, 140)
    assert last.usage.cached_tokens == 256 and tokens == reference(second, 20)

    # prefill C reads through the KV writer (KvReadPages); the window at 384 comes from the decode worker
    third = full[:384] + make_prompt(140, 3).tolist()
    done, tokens, last = await generate(s, s.prefill_c, "r3", third, 16, hit=384)
    assert (done.hit_tokens, done.computed_tokens) == (384, 140)
    assert last.usage.cached_tokens == 384 and tokens == reference(third, 16)


async def test_without_the_window_at_l1_the_hit_is_one_block_less_and_without_either_none(stack, reference):
    s = stack
    prompt = make_prompt(280, 4).tolist()
    await generate(s, s.prefill_a, "r1", prompt, 8)
    hashes = block_hashes(s.decode.model_id, prompt)
    await eventually(lambda: s.kv.store.lookup(hashes) == 2, timeout=10, what="prompt blocks persisted")
    await eventually(lambda: s.prefill_a.persister.states_registered >= 2, timeout=10, what="states registered")
    # prefill A holds the windows at 128 and 256; once it no longer advertises the one at 256,
    # prefill B gets the one at 128 (L1 - 128)
    await s.gw.call(s.swa.config.advertise, SwaUnregister([hashes[1]], s.prefill_a.config.advertise, ack=True))
    second = prompt[:256] + make_prompt(140, 5).tolist()
    done, tokens, last = await generate(s, s.prefill_b, "r2", second, 8, hit=256)
    assert done.hit_tokens == 128 and last.usage.cached_tokens == 128 and tokens == reference(second, 8)
    # neither window advertised (prefill B now holds both too): prefill C (which holds none) computes everything
    await eventually(lambda: s.swa.registry.lookup(hashes[:2]) == [s.prefill_b.config.advertise] * 2, timeout=10,
                     what="prefill B advertises both windows")
    for worker in (s.prefill_a, s.prefill_b):
        await s.gw.call(s.swa.config.advertise, SwaUnregister(hashes[:2], worker.config.advertise, ack=True))
    assert s.swa.registry.lookup(hashes[:2]) == ["", ""]
    third = prompt[:256] + make_prompt(140, 6).tolist()
    done, tokens, last = await generate(s, s.prefill_c, "r3", third, 8, hit=256)
    assert done.hit_tokens == 0 and last.usage.cached_tokens == 0 and tokens == reference(third, 8)


async def test_first_token_that_finishes_and_bad_work(stack, reference):
    s = stack
    prompt = make_prompt(50, 6).tolist()
    done, tokens, last = await generate(s, s.prefill_a, "one", prompt, 1)
    assert tokens == reference(prompt, 1) and last.finish_reason == int(FinishReason.LENGTH)
    assert last.usage.completion_tokens == 1 and not s.decode.streams
    request = GenerateRequest(model="tiny", prompt_ids=prompt, sampling=greedy_params(4),
                              return_address=s.gw.config.advertise)
    with pytest.raises(RemoteError) as err:   # no decode instance chosen
        await s.gw.call(s.prefill_a.config.advertise, PrefillWork(request), request_id="bad")
    assert err.value.code == ErrorCode.INVALID_REQUEST
    big = GenerateRequest(model="tiny", prompt_ids=[10**9], sampling=greedy_params(4),
                          return_address=s.gw.config.advertise)
    with pytest.raises(RemoteError) as err:   # the engine refuses the prompt
        await s.gw.call(s.prefill_a.config.advertise, PrefillWork(big, 0, s.decode.config.advertise),
                        request_id="bad2")
    assert err.value.code == ErrorCode.INVALID_REQUEST
    assert not s.prefill_a.jobs


async def test_abort_frees_a_decoding_request_and_a_fresh_request_still_runs(stack, reference):
    s = stack
    prompt = make_prompt(140, 7).tolist()
    request = GenerateRequest(model="tiny", prompt_ids=prompt, sampling=greedy_params(3000),
                              block_hashes=block_hashes(s.decode.model_id, prompt),
                              return_address=s.gw.config.advertise)
    done = (await s.gw.call(s.prefill_a.config.advertise, PrefillWork(request, 0, s.decode.config.advertise),
                            request_id="long", timeout=120)).message
    assert done.computed_tokens == 140
    await eventually(lambda: len(s.gw.tokens("long")) > 3 if "long" in s.gw.chunks else False, timeout=60,
                     what="decoding")
    assert s.decode.load().batch_size == 1 and s.decode.load().in_flight == 1
    s.gw.send(s.decode.config.advertise, AbortRequest("client"), request_id="long")
    await eventually(lambda: not s.decode.streams, timeout=10, what="stream freed")
    await engine_empty(s.decode)
    produced = len(s.gw.tokens("long"))
    assert not s.gw.finished("long") and produced < 3000
    assert s.gw.tokens("long") == reference(prompt, produced)   # what it sent was right
    prompt2 = make_prompt(20, 8).tolist()
    _, tokens, _ = await generate(s, s.prefill_a, "after", prompt2, 10)
    assert tokens == reference(prompt2, 10)


async def test_logprobs_cover_every_token_the_hand_off_included(stack, reference):
    s = stack
    prompt = make_prompt(40, 9).tolist()
    sampling = greedy_params(6, logprobs=True, top_logprobs=3)
    request = GenerateRequest(model="tiny", prompt_ids=prompt, sampling=sampling, return_address=s.gw.config.advertise)
    await s.gw.call(s.prefill_a.config.advertise, PrefillWork(request, 0, s.decode.config.advertise),
                    request_id="lp", timeout=120)
    await eventually(lambda: s.gw.finished("lp"), timeout=60, what="finished")
    chunks = s.gw.chunks["lp"]
    assert len(chunks[0].token_ids) == 1   # the prefill worker's first token, streamed by the decode worker
    assert all(len(c.logprobs) == len(c.top_logprobs) == len(c.token_ids) for c in chunks)
    expected = reference.collect(prompt, sampling)
    assert s.gw.tokens("lp") == expected.tokens
    assert [lp for c in chunks for lp in c.logprobs] == pytest.approx(expected.logprobs, abs=1e-5)
    tops = [row for c in chunks for row in c.top_logprobs]
    assert all(len(row) == 3 and row[0].token_id == token for row, token in zip(tops, expected.tokens))


async def test_a_hand_off_with_misaligned_logprobs_is_refused(stack):
    s = stack
    request = GenerateRequest(model="tiny", prompt_ids=[1, 2, 3], sampling=greedy_params(4, logprobs=True),
                              return_address=s.gw.config.advertise)
    with pytest.raises(RemoteError) as err:
        await s.gw.call(s.decode.config.advertise, StateHandoff(request, KVSnapshot(), [], [5], [-0.1, -0.2]),
                        request_id="misaligned")
    assert err.value.code == ErrorCode.INVALID_REQUEST and "logprobs" in err.value.message
    assert not s.decode.streams


async def test_a_dead_gateways_requests_are_freed(stack):
    s = stack
    prompt = make_prompt(30, 10).tolist()
    request = GenerateRequest(model="tiny", prompt_ids=prompt, sampling=greedy_params(3000),
                              return_address=s.gw.config.advertise)
    await s.gw.call(s.prefill_a.config.advertise, PrefillWork(request, 0, s.decode.config.advertise),
                    request_id="orphan", timeout=120)
    await eventually(lambda: len(s.gw.chunks.get("orphan", [])) > 2, timeout=60, what="decoding")
    s.gw.stop()
    await eventually(lambda: not s.decode.streams, timeout=10, what="orphan freed")
    await engine_empty(s.decode)


async def test_a_refused_hand_off_fails_the_work_and_frees_the_prefill_state(stack):
    s = stack
    prompt = make_prompt(30, 11).tolist()
    request = GenerateRequest(model="tiny", prompt_ids=prompt, sampling=greedy_params(3000),
                              return_address=s.gw.config.advertise)
    work = PrefillWork(request, 0, s.decode.config.advertise)
    await s.gw.call(s.prefill_a.config.advertise, work, request_id="dup", timeout=120)
    with pytest.raises(RemoteError) as err:   # the decode worker already runs "dup": it refuses the state
        await s.gw.call(s.prefill_b.config.advertise, work, request_id="dup", timeout=120)
    assert err.value.code == ErrorCode.INVALID_REQUEST and "already running" in err.value.message
    assert await s.prefill_b.engine(lambda engine: engine.request_ids()) == [] and not s.prefill_b.jobs
    assert s.prefill_b.load().in_flight == 0 and s.prefill_b.load().queued_tokens == 0
    assert "dup" in s.decode.streams   # the refusal left the running request alone


async def test_a_hand_off_to_a_dead_decode_worker_fails_as_peer_dead_in_seconds_not_at_the_timeout(stack):
    """The prefill worker watches the decode worker during the hand-off (liveness probes): a dead one
    fails the work as PEER_DEAD within about dead_after_s, which the gateway resumes elsewhere."""
    import time
    from tests.helpers.test_helper_stack import free_port_base
    s = stack
    dead = f"tcp://127.0.0.1:{free_port_base(1, offset=0)}"   # nobody listens there
    request = GenerateRequest(model="tiny", prompt_ids=make_prompt(30, 12).tolist(), sampling=greedy_params(8),
                              return_address=s.gw.config.advertise)
    started = time.monotonic()
    with pytest.raises(RemoteError) as err:
        await s.gw.call(s.prefill_a.config.advertise, PrefillWork(request, 0, dead), request_id="orphan", timeout=60)
    took = time.monotonic() - started
    assert err.value.code == ErrorCode.PEER_DEAD and dead in err.value.message
    assert took < s.prefill_a.config.dead_after_s + 5 < s.prefill_a.settings.handoff_timeout_s
    await engine_empty(s.prefill_a)
    assert not s.prefill_a.jobs
