"""GrammarCompilerService over real ZeroMQ: GrammarCompiled, cache hits, one compile for concurrent
requests, typed ErrorReply codes (wrong tokenizer or key, unsupported keyword, timeout answered again
from the cache), metrics; settings checked; `epd serve grammar_compiler` registers upstream and answers."""
from __future__ import annotations

import asyncio
import time

import pytest
import zmq

from messages import Codec
from messages.errors import ErrorCode, ErrorReply, RemoteError
from messages.grammar import GrammarCompile, GrammarCompiled, constraint_key, tokenizer_id
from services.catalog import resolve
from services.grammar_compiler.service import GrammarCompilerService, GrammarCompilerSettings
from services.runtime.config import ServiceConfig
from services.runtime.service import Service
from services.runtime.settings import parse_settings
from tests.grammar_compiler.test_helper_constraints import SIMPLE_SCHEMA, SLOW_SCHEMA, json_schema
from tests.helpers.test_helper_processes import procs, tcp_config, wait_until  # noqa: F401 - procs is a fixture
from tests.helpers.test_helper_services import InProcessServices

NOT_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}}


def test_the_catalog_knows_the_kind_and_settings_need_a_model_dir():
    assert resolve("grammar_compiler") is GrammarCompilerService
    with pytest.raises(ValueError, match="model_dir is required"):
        parse_settings(GrammarCompilerSettings, {}, "grammar_compiler")
    with pytest.raises(ValueError, match="unknown setting 'timeout_s'"):
        parse_settings(GrammarCompilerSettings, {"model_dir": "/m", "timeout_s": 1}, "grammar_compiler")
    with pytest.raises(ValueError, match="compile_timeout_s must be a positive"):
        parse_settings(GrammarCompilerSettings, {"model_dir": "/m", "compile_timeout_s": 0}, "grammar_compiler")
    settings = parse_settings(GrammarCompilerSettings, {"model_dir": "/m"}, "grammar_compiler")
    assert (settings.processes, settings.compile_timeout_s) == (2, 10.0)
    assert str(settings.tokenizer_json) == "/m/tokenizer.json"


async def test_a_model_dir_without_tokenizer_fails_the_start(tmp_path):
    service = GrammarCompilerService(ServiceConfig(kind="grammar_compiler", bind=f"ipc://{tmp_path}/gc.sock",
                                                   settings={"model_dir": str(tmp_path)}))
    assert await service.run(install_signals=False) == 1
    assert "tokenizer.json does not exist" in service.failure


def sample(service: GrammarCompilerService, name: str) -> float:
    return service.metrics.registry.get_sample_value(name, {"kind": "grammar_compiler", "instance": "gc"})


async def compile_error(client: Service, address: str, message: GrammarCompile) -> RemoteError:
    with pytest.raises(RemoteError) as refused:
        await client.call(address, message, timeout=10.0)
    return refused.value


@pytest.mark.slow   # starts a compile process
async def test_the_service_compiles_caches_and_answers_typed_errors(tmp_path, compiler_model_dir):
    services = InProcessServices(tmp_path)
    try:
        compiler = await services.start(GrammarCompilerService, "gc", settings={
            "model_dir": str(compiler_model_dir), "processes": 1, "compile_timeout_s": 1.0})
        client = await services.start(Service, "client")
        address, tid = compiler.config.advertise, tokenizer_id(compiler_model_dir / "tokenizer.json")
        assert compiler.tokenizer_id == tid
        simple = json_schema(SIMPLE_SCHEMA)

        gateway, worker = await asyncio.gather(*(client.call(address, GrammarCompile(simple, tid), timeout=10.0)
                                                 for _ in range(2)))
        first = gateway.message
        assert isinstance(first, GrammarCompiled) and first.key == constraint_key(tid, simple)
        assert first.library == "llguidance" and '"name":{"type":"string"}' in first.grammar
        assert first.compile_ms > 0 and not first.cached
        assert worker.message.grammar == first.grammar and not worker.message.cached   # joined the compile
        hit = (await client.call(address, GrammarCompile(simple, tid, key=first.key))).message
        assert (hit.grammar, hit.cached, hit.compile_ms) == (first.grammar, True, 0.0)

        wrong_tokenizer = await compile_error(client, address, GrammarCompile(simple, "0123456789abcdef"))
        assert wrong_tokenizer.code == ErrorCode.INVALID_REQUEST and tid in wrong_tokenizer.message
        wrong_key = await compile_error(client, address, GrammarCompile(simple, tid, key="f" * 32))
        assert wrong_key.code == ErrorCode.INVALID_REQUEST and "is not the constraint's key" in wrong_key.message
        unsupported = await compile_error(client, address, GrammarCompile(json_schema(NOT_SCHEMA), tid))
        assert unsupported.code == ErrorCode.GRAMMAR_UNSUPPORTED and "keyword 'not'" in unsupported.message
        lenient = (await client.call(address, GrammarCompile(json_schema(NOT_SCHEMA, strict=False), tid))).message
        assert isinstance(lenient, GrammarCompiled) and not lenient.cached

        slow = GrammarCompile(json_schema(SLOW_SCHEMA), tid)
        timed_out = await compile_error(client, address, slow)
        assert timed_out.code == ErrorCode.GRAMMAR_TIMEOUT and "longer than 1 s" in timed_out.message
        retried_at = time.monotonic()
        again = await compile_error(client, address, slow)   # from the cache: no process spent on it
        assert again.code == ErrorCode.GRAMMAR_TIMEOUT and time.monotonic() - retried_at < 0.5

        assert compiler.pool.stats.timeouts == 1
        assert sample(compiler, "epd_grammar_requests_total") == 9
        assert sample(compiler, "epd_grammar_compiles_total") == 2
        assert sample(compiler, "epd_grammar_cache_hits_total") == 1
        assert sample(compiler, "epd_grammar_cache_joins_total") == 1
        assert sample(compiler, "epd_grammar_cache_error_hits_total") == 1
        assert sample(compiler, "epd_grammar_invalid_total") == 2
        assert sample(compiler, "epd_grammar_unsupported_total") == 1
        assert sample(compiler, "epd_grammar_timeouts_total") == 2
        assert sample(compiler, "epd_grammar_process_kills_total") == 1
        assert sample(compiler, "epd_grammar_compile_seconds_count") == 2
        assert sample(compiler, "epd_grammar_cache_entries") == 4   # simple, lenient, two refusals
    finally:
        await services.close()


def ask(address: str, message, timeout_s: float = 30.0):
    """One request from a plain DEALER; the reply message, ErrorReply included."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    codec = Codec(sender="test-client")
    try:
        sock.connect(address)
        sock.send_multipart(codec.encode(message))
        assert sock.poll(int(timeout_s * 1000)), f"no reply within {timeout_s}s"
        return codec.decode(sock.recv_multipart()).message
    finally:
        sock.close(0)
        ctx.term()


@pytest.mark.slow   # starts service processes
def test_epd_serve_grammar_compiler_registers_upstream_and_answers(procs, compiler_model_dir):
    hub, other_hub = (procs(tcp_config("echo", f"hub-{i}", heartbeat_s=0.5)) for i in range(2))   # two gateways
    hub.wait_running()
    other_hub.wait_running()
    compiler = procs(tcp_config("grammar_compiler", "gc-0", upstream=hub.address, heartbeat_s=0.5,
                                upstream_replicas=(other_hub.address,),
                                settings={"model_dir": str(compiler_model_dir), "processes": 1}))
    compiler.wait_running(timeout_s=60, upstream=True)
    for each in (hub, other_hub):
        wait_until(lambda: any(p.instance == "gc-0" and p.kind == "grammar_compiler" for p in each.status().peers),
                   10, f"the compiler registered with {each.config.instance}")
    tid = tokenizer_id(compiler_model_dir / "tokenizer.json")
    compiled = ask(compiler.address, GrammarCompile(json_schema(SIMPLE_SCHEMA), tid))
    assert isinstance(compiled, GrammarCompiled) and '"age":{"type":"integer"}' in compiled.grammar
    refused = ask(compiler.address, GrammarCompile(json_schema(NOT_SCHEMA), tid))
    assert isinstance(refused, ErrorReply) and refused.code == ErrorCode.GRAMMAR_UNSUPPORTED
    assert '"event": "grammar.compile"' in compiler.log() and '"outcome": "GRAMMAR_UNSUPPORTED"' in compiler.log()
