"""cache.py: a hit needs no compile, concurrent requests share one compile, verdicts are kept for
error_ttl_s (capacity refusals are not), and the byte budget evicts the least recently used."""
from __future__ import annotations

import asyncio

from messages.errors import ErrorCode, GrammarTimeout, GrammarUnsupported, Overloaded
from services.grammar_compiler.cache import ENTRY_OVERHEAD_BYTES, GrammarCache
from services.grammar_compiler.pool import CompileCrashed
from tests.helpers.test_helper_async import eventually


class TestHelperCompiles:
    """Test-only compile function: counts calls, answers `outcome` (a grammar or an exception to
    raise), and holds every call at `gate` until the test opens it."""

    __test__ = False   # not a pytest test class

    def __init__(self, outcome="grammar-text", compile_ms: float = 12.5):
        self.calls = 0
        self.outcome = outcome
        self.compile_ms = compile_ms
        self.gate = asyncio.Event()
        self.gate.set()

    async def __call__(self) -> tuple[str, float]:
        self.calls += 1
        await self.gate.wait()
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome, self.compile_ms


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_second_request_is_answered_from_the_cache_without_a_compile():
    cache, compile = GrammarCache(1 << 20, error_ttl_s=5), TestHelperCompiles()
    first = await cache.get("k", compile)
    second = await cache.get("k", compile)
    assert (first.grammar, first.compile_ms, first.source) == ("grammar-text", 12.5, "compiled")
    assert (second.grammar, second.source, second.error) == ("grammar-text", "cached", None)
    assert compile.calls == 1 and cache.stats.hits == 1 and cache.stats.misses == 1


async def test_concurrent_requests_for_one_key_share_one_compile():
    cache, compile = GrammarCache(1 << 20, error_ttl_s=5), TestHelperCompiles()
    compile.gate.clear()
    gateway = asyncio.ensure_future(cache.get("k", compile))
    worker = asyncio.ensure_future(cache.get("k", compile))
    other_key = asyncio.ensure_future(cache.get("other", compile))
    await eventually(lambda: compile.calls == 2, what="two compiles started")
    assert cache.in_flight == 2 and cache.stats.joins == 1
    compile.gate.set()
    answers = await asyncio.gather(gateway, worker, other_key)
    assert [a.source for a in answers] == ["compiled", "joined", "compiled"]
    assert {a.grammar for a in answers} == {"grammar-text"} and answers[1].compile_ms == 12.5
    assert compile.calls == 2 and cache.stats.joins == 1 and cache.in_flight == 0


async def test_a_caller_that_gives_up_does_not_cancel_the_compile_the_others_wait_for():
    cache, compile = GrammarCache(1 << 20, error_ttl_s=5), TestHelperCompiles()
    compile.gate.clear()
    impatient = asyncio.ensure_future(cache.get("k", compile))
    patient = asyncio.ensure_future(cache.get("k", compile))
    await eventually(lambda: compile.calls == 1 and cache.stats.joins == 1, what="both waiting on one compile")
    impatient.cancel()
    compile.gate.set()
    assert (await patient).grammar == "grammar-text"
    assert impatient.cancelled()
    assert (await cache.get("k", compile)).source == "cached" and compile.calls == 1


async def test_a_verdict_is_answered_from_the_cache_until_error_ttl_s_passes():
    clock = Clock()
    cache = GrammarCache(1 << 20, error_ttl_s=5, clock=clock)
    compile = TestHelperCompiles(GrammarTimeout("compiling the constraint took longer than 10 s"))
    first = await cache.get("k", compile)
    clock.now += 4.9
    retried = await cache.get("k", compile)
    assert compile.calls == 1 and retried.source == "cached" and cache.stats.error_hits == 1
    assert type(retried.error) is GrammarTimeout and retried.error.message == first.error.message
    assert retried.error is not first.error   # each answer its own exception
    clock.now += 0.2
    compile.outcome = "grammar-text"
    assert (await cache.get("k", compile)).source == "compiled" and compile.calls == 2


async def test_every_verdict_kind_is_kept_but_overload_is_not():
    for verdict in (GrammarUnsupported("the JSON schema keyword 'not' is not supported"),
                    CompileCrashed("the compile process died (killed by signal 9) while compiling the constraint")):
        cache, compile = GrammarCache(1 << 20, error_ttl_s=5), TestHelperCompiles(verdict)
        await cache.get("k", compile)
        assert (await cache.get("k", compile)).error.code == verdict.code and compile.calls == 1
    cache, compile = GrammarCache(1 << 20, error_ttl_s=5), TestHelperCompiles(Overloaded("256 compiles are waiting"))
    assert (await cache.get("k", compile)).error.code == ErrorCode.OVERLOADED
    await cache.get("k", compile)
    assert compile.calls == 2 and len(cache) == 0


async def test_joined_callers_get_the_failure_each_as_its_own_exception():
    cache = GrammarCache(1 << 20, error_ttl_s=5)
    compile = TestHelperCompiles(GrammarUnsupported("the JSON schema keyword 'not' is not supported"))
    compile.gate.clear()
    waiting = [asyncio.ensure_future(cache.get("k", compile)) for _ in range(2)]
    await eventually(lambda: compile.calls == 1 and cache.stats.joins == 1, what="both waiting on one compile")
    compile.gate.set()
    first, second = await asyncio.gather(*waiting)
    assert [first.source, second.source] == ["compiled", "joined"]
    assert first.error.message == second.error.message and first.error is not second.error


async def test_the_byte_budget_evicts_the_least_recently_used_artifact():
    size = 1000 + ENTRY_OVERHEAD_BYTES
    cache = GrammarCache(max_bytes=2 * size, error_ttl_s=5)
    for key in ("a", "b"):
        await cache.get(key, TestHelperCompiles(key * 1000))
    await cache.get("a", TestHelperCompiles())   # a is now the most recently used
    await cache.get("c", TestHelperCompiles("c" * 1000))
    assert cache.bytes == 2 * size and cache.stats.evictions == 1
    assert (await cache.get("a", TestHelperCompiles())).source == "cached"
    assert (await cache.get("b", TestHelperCompiles("b" * 1000))).source == "compiled"   # evicted


async def test_an_artifact_larger_than_the_budget_is_answered_but_not_kept():
    cache = GrammarCache(max_bytes=4096, error_ttl_s=5)
    await cache.get("small", TestHelperCompiles("s"))
    huge = await cache.get("huge", TestHelperCompiles("h" * 10_000))
    assert huge.grammar == "h" * 10_000 and len(cache) == 1
    assert (await cache.get("small", TestHelperCompiles())).source == "cached"
