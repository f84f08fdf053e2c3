"""The gateway's side of structured output (services/gateway/grammar_calls.py, http_app.py): it sends
a constrained request upstream at once, naming the compiler replica it asks in parallel; a constraint
the compiler refuses is a 400 naming what was refused, in the caller's shape, and the request already
sent is aborted. In-process over real ZeroMQ with a test-only refusing compiler and recording upstream."""
from __future__ import annotations

from types import SimpleNamespace

import aiohttp
import pytest

from messages.errors import ErrorCode, RemoteError
from services.gateway.grammar_calls import COMPILER_KIND, compile_failure, pick_compiler
from services.gateway.service import GatewayService
from services.runtime.membership import MembershipTable
from tests.gateway.conftest import MODEL
from tests.gateway.test_gateway_streams import start
from tests.helpers.test_helper_async import eventually
from tests.helpers.test_helper_grammar_compiler import TestHelperRecordingUpstream, TestHelperRefusingCompiler
from tests.helpers.test_helper_stack import free_port_base

KEYWORD = "uniqueItems"   # what the test compiler says it cannot enforce
SCHEMA = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
          "required": ["tags"], "additionalProperties": False}
NO_THINKING = {"thinking": {"type": "disabled"}}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **NO_THINKING,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}}
MESSAGES = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **NO_THINKING,
            "output_format": {"type": "json_schema", "schema": SCHEMA}}


@pytest.fixture
async def grammar_stack(tmp_path):
    """(gateway, recording upstream, refusing compiler registered with the gateway, http session)."""
    started: list = []
    upstream = await start(TestHelperRecordingUpstream, tmp_path, "upstream", started)
    port = free_port_base(1, offset=0)
    gateway = await start(GatewayService, tmp_path, "gw", started, upstream=upstream.config.advertise,
                          settings={"http_bind": f"127.0.0.1:{port}", "context_length": 4096})
    compiler = await start(TestHelperRefusingCompiler, tmp_path, "compiler", started, upstream=gateway.config.advertise,
                           settings={"message": f"keyword '{KEYWORD}' is not supported by the grammar library"})
    await eventually(lambda: gateway.upstream.connected and gateway.members.alive(COMPILER_KIND),
                     what="the gateway and the compiler to register")
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
            yield gateway, upstream, compiler, http
    finally:
        for svc, task in reversed(started):
            svc.stop()
            assert await task == 0


async def test_a_refused_constraint_is_a_400_naming_it_and_the_request_sent_upstream_is_aborted(grammar_stack):
    gateway, upstream, compiler, http = grammar_stack
    for path, body, request_id in (("/v1/chat/completions", CHAT, "req-chat"), ("/v1/messages", MESSAGES, "req-msg")):
        async with http.post(path, json=body, headers={"x-request-id": request_id}) as r:
            status, payload = r.status, await r.json()
        assert status == 400, payload
        message = payload["error"]["message"]
        assert KEYWORD in message
        if path == "/v1/messages":
            assert payload == {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
        else:
            assert payload["error"]["type"] == "invalid_request_error"
            assert payload["error"]["code"] == "unsupported_schema_feature"
        await eventually(lambda: ("AbortRequest", request_id) in [(t, i) for t, i, _ in upstream.received],
                         what="the abort to reach the upstream")
        mine = [(kind, msg) for kind, rid, msg in upstream.received if rid == request_id]
        assert [kind for kind, _ in mine] == ["GenerateRequest", "AbortRequest"]   # sent at once, then stopped
        sent, abort = mine[0][1], mine[1][1]
        [asked] = [msg for rid, msg in compiler.compiles if rid == request_id]
        assert sent.grammar.compiler == compiler.config.advertise            # the worker asks the same replica
        assert (asked.key, asked.constraint, asked.tokenizer_id) == (
            sent.grammar.key, sent.grammar.constraint, sent.grammar.tokenizer_id)
        assert abort.reason == "unsupported_schema_feature"
    assert gateway.pending == {}


# ---- the pure parts: which replica, and what its refusal means to the client ---------------------

@pytest.mark.parametrize("code,status,client_code", [
    (ErrorCode.GRAMMAR_UNSUPPORTED, 400, "unsupported_schema_feature"),
    (ErrorCode.GRAMMAR_TIMEOUT, 400, "grammar_too_complex"),
    (ErrorCode.INVALID_REQUEST, 400, "invalid_schema"),
    (ErrorCode.TIMEOUT, 503, "grammar_compiler_unavailable"),     # no answer: retry, the schema may be fine
    (ErrorCode.PEER_DEAD, 503, "grammar_compiler_unavailable"),
])
def test_each_compiler_answer_is_the_clients_error(code, status, client_code):
    error = compile_failure(RemoteError(int(code), "keyword 'x' is not supported"))
    assert (error.status, error.code) == (status, client_code) and "keyword 'x'" in error.message


def members(*peers: tuple[str, str, bool]) -> SimpleNamespace:
    """A service whose membership holds (instance, kind, alive) peers at address tcp://<instance>."""
    table = MembershipTable(dead_after_s=1.0)
    for instance, kind, alive in peers:
        table.register(instance, kind, f"tcp://{instance}", "", now=0.0).alive = alive
    return SimpleNamespace(members=table)


def test_a_constraint_goes_to_a_live_compiler_and_a_replica_leaving_moves_only_its_keys():
    keys = [f"key-{i}" for i in range(200)]
    three = members(("c1", COMPILER_KIND, True), ("c2", COMPILER_KIND, True), ("c3", COMPILER_KIND, True),
                    ("w1", "unified_worker", True))
    before = {k: pick_compiler(three, k) for k in keys}
    assert set(before.values()) == {"tcp://c1", "tcp://c2", "tcp://c3"}           # spread, never a worker
    assert all(pick_compiler(three, k) == before[k] for k in keys)                 # stable: repeats hit its cache
    three.members.get("c2").alive = False
    after = {k: pick_compiler(three, k) for k in keys}
    assert set(after.values()) == {"tcp://c1", "tcp://c3"}
    assert all(after[k] == before[k] for k in keys if before[k] != "tcp://c2")     # only c2's keys moved
    assert pick_compiler(members(("c1", COMPILER_KIND, False), ("w1", "unified_worker", True)), "k") == ""
