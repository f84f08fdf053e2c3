"""Real prefill and decode workers in-process over real ZeroMQ, with a real KV writer and SWA registry,
when a worker or the registry restarts at the same address:

- a prefill worker restarted at its old address is a new incarnation: the registry drops what its
  predecessor registered at once, never takes those entries for the new process's own, and serves
  the window from another process that still holds it, so the prefix hit survives (it fell to 0);
- a restarted SWA registry knows nothing: the workers notice (their periodic registration check is
  answered `known=False`) and register every window state they still hold, so hits resume.
"""
from __future__ import annotations

import pytest

from engine.engine_core import EngineConfig, EngineCore, EngineRequest
from messages.generate import GenerateRequest
from messages.prefix import block_hashes
from messages.routing import PrefillDone, PrefillWork
from services.kv_writer.service import KvWriterService
from services.runtime.service import Service
from services.swa_registry.service import SwaRegistryService
from services.workers.decode import DecodeWorker
from services.workers.prefill import PrefillWorker
from tests.engine.references import greedy_params, make_prompt, run_engine
from tests.helpers.test_helper_async import eventually
from tests.swa_registry.test_helper_restarts import RestartableServices
from tests.workers.test_workers_inprocess import TestHelperGateway, engine_settings


class Stack(RestartableServices):
    def __init__(self, tmp_path, model_dir):
        super().__init__(tmp_path)
        self.model_dir = model_dir

    def prefill_settings(self) -> dict:
        return {**engine_settings(self.model_dir), **self.peers(), "kv_store_dir": str(self.tmp_path / "kvstore")}

    def peers(self) -> dict:
        return {"kv_writer": self.kv.config.advertise, "swa_registry": self.swa.config.advertise}


@pytest.fixture
async def stack(tmp_path, tiny_model_dir):
    s = Stack(tmp_path, tiny_model_dir)
    s.kv = await s.start(KvWriterService, "kv", {"root": str(tmp_path / "kvstore")})
    s.swa = await s.start(SwaRegistryService, "swa")
    s.gw = await s.start(TestHelperGateway, "gw")
    s.decode = await s.start(DecodeWorker, "decode", {**engine_settings(tiny_model_dir), **s.peers()})
    s.prefill_a = await s.start(PrefillWorker, "prefill-a", s.prefill_settings())
    s.prefill_b = await s.start(PrefillWorker, "prefill-b", s.prefill_settings())
    yield s
    await s.close()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """A unified engine: what a prompt should produce."""
    engine = EngineCore(EngineConfig(**engine_settings(tiny_model_dir)))

    def run(prompt: list[int], max_tokens: int) -> list[int]:
        engine.add_request(EngineRequest("ref", prompt, greedy_params(max_tokens)))
        return run_engine(engine)["ref"].tokens
    return run


async def generate(s: Stack, prefill: Service, rid: str, prompt: list[int], max_tokens: int,
                   hit: int = 0) -> tuple[PrefillDone, list[int]]:
    request = GenerateRequest(model="tiny", prompt_ids=prompt, sampling=greedy_params(max_tokens),
                              block_hashes=block_hashes(s.decode.model_id, prompt),
                              return_address=s.gw.config.advertise)
    done = (await s.gw.call(prefill.config.advertise, PrefillWork(request, hit, s.decode.config.advertise),
                            request_id=rid, timeout=120)).message
    await eventually(lambda: s.gw.finished(rid), timeout=120, what=f"{rid} finished")
    return done, s.gw.tokens(rid)


async def holds_windows(worker, hashes: list[bytes]) -> bool:
    return await worker.engine(lambda engine: all(h in engine.kv.boundaries for h in hashes))


async def test_a_restarted_prefill_worker_is_not_taken_for_its_predecessor(stack, reference):
    s = stack
    shared = make_prompt(256, 21).tolist()
    hashes = block_hashes(s.decode.model_id, shared)          # the windows at 128 and 256
    # B and then A compute prompts sharing 256 tokens: both hold both windows; A registered last
    await generate(s, s.prefill_b, "b1", shared + make_prompt(40, 22).tolist(), 4)
    await eventually(lambda: s.swa.registry.lookup(hashes) == [s.prefill_b.config.advertise] * 2, timeout=10,
                     what="B's windows registered")
    await generate(s, s.prefill_a, "a1", shared + make_prompt(40, 23).tolist(), 4)
    await eventually(lambda: s.swa.registry.lookup(hashes) == [s.prefill_a.config.advertise] * 2, timeout=10,
                     what="A's windows registered")
    assert await holds_windows(s.prefill_a, hashes) and await holds_windows(s.prefill_b, hashes)

    old_a = s.prefill_a
    s.prefill_a = await s.restart(old_a)                       # same address, a new process: it holds nothing
    assert not await holds_windows(s.prefill_a, hashes)
    # the new process announced itself: its predecessor's entries went at once, B's remain
    await eventually(lambda: s.swa.registry.lookup(hashes) == [s.prefill_b.config.advertise] * 2, timeout=5,
                     what="the old incarnation's entries dropped")

    # the restarted A takes the window from B through the registry: the hit survives the restart
    prompt = shared + make_prompt(140, 24).tolist()
    done, tokens = await generate(s, s.prefill_a, "a2", prompt, 6, hit=256)
    assert (done.hit_tokens, done.computed_tokens) == (256, 140)
    assert tokens == reference(prompt, 6)


async def test_workers_register_their_windows_again_when_the_registry_restarts(stack, reference):
    s = stack
    shared = make_prompt(256, 31).tolist()
    hashes = block_hashes(s.decode.model_id, shared)
    await generate(s, s.prefill_a, "a1", shared + make_prompt(40, 32).tolist(), 4)
    await eventually(lambda: s.swa.registry.lookup(hashes) == [s.prefill_a.config.advertise] * 2, timeout=10,
                     what="A's windows registered")

    s.swa = await s.restart(s.swa)                             # a new registry: empty
    # every worker re-registers what it still holds (A: both windows), within a few checks
    await eventually(lambda: s.swa.registry.lookup(hashes) == [s.prefill_a.config.advertise] * 2, timeout=5,
                     what="A's windows registered with the restarted registry")

    # B holds nothing: the window at 256 comes from A through the restarted registry
    prompt = shared + make_prompt(140, 33).tolist()
    done, tokens = await generate(s, s.prefill_b, "b1", prompt, 6, hit=256)
    assert (done.hit_tokens, done.computed_tokens) == (256, 140)
    assert tokens == reference(prompt, 6)
