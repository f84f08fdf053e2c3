"""Constrained requests through real workers in-process over real ZeroMQ, with a real grammar compiler
(one compile process) on the tiny V4.1 model: the unified worker streams JSON that validates and
stops, beside an unconstrained request it leaves unchanged; a resumed attempt (grammar replay) ends
with exactly the uninterrupted run's tokens; a prefill -> decode hand-off carries the grammar and the
decode worker refuses a constrained state without it; compiler refusals and a foreign tokenizer are
typed errors that leave no stream; an abort during the unified worker's grammar fetch, or during the
decode worker's matcher build, leaves nothing running.

One stack per module (engines and the compile process start once); batch-invariant engines make
"the same as alone" and "the same as uninterrupted" exact."""
from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
import pytest_asyncio

from engine.grammar import load_grammar_tokenizer
from messages.common import FinishReason, SamplingParams
from messages.errors import ErrorCode, ErrorReply, RemoteError
from messages.generate import AbortRequest, GenerateChunk, GenerateRequest
from messages.grammar import GrammarCompile, GrammarRef, constraint_json, constraint_key, tokenizer_id
from messages.handoff import KVSnapshot, StateHandoff
from messages.routing import PrefillWork
from services.gateway.resume import resumed_request
from services.grammar_compiler.service import GrammarCompilerService
from services.runtime.service import Service
from services.workers.decode import DecodeWorker
from services.workers.prefill import PrefillWorker
from services.workers.unified import UnifiedWorker
from tests.engine.references import greedy_params
from tests.helpers.test_helper_async import eventually
from tests.helpers.test_helper_services import InProcessServices
from tests.workers.test_workers_inprocess import TestHelperGateway, engine_empty, engine_settings

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

VOCAB, EOS = 129280, 1
PROMPT = [0, 128803, 4, 17, 300, 5000, 128804]   # BOS <User> ... <Assistant>
OTHER_PROMPT = [0, 128803, 99, 1000, 128804]
# Bounded leaves: random weights still finish the object within a few dozen tokens.
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["k", "n", "s"],
          "properties": {"k": {"enum": ["cat", "dog", "emu"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "s": {"type": "string", "maxLength": 6}}}
# A 200-character string: a request wrongly run after its abort is still running when looked for.
LONG_STRING = {"type": "string", "minLength": 200, "maxLength": 200}
JSON_TOKENS = 64      # budget of a constrained request (it stops at the object's end, well before)
PLAIN_TOKENS = 16
RESUME_AT = 5


def json_schema(schema: dict) -> dict:
    return {"kind": "json_schema", "schema": schema, "strict": True}


class TestHelperGrammarGateway(TestHelperGateway):
    """Test-only: the workers' gateway, also keeping the ErrorReply a refused GenerateRequest gets and
    the order chunks arrived in (which requests shared engine steps)."""

    kind = "test_grammar_gateway"
    __test__ = False

    def __init__(self, config):
        super().__init__(config)
        self.errors: dict[str, ErrorReply] = {}
        self.arrivals: list[str] = []

    def handlers(self):
        return {**super().handlers(), ErrorReply: self._on_error}

    async def _on_chunk(self, msg: GenerateChunk, ctx) -> None:
        self.arrivals.append(ctx.request_id)
        await super()._on_chunk(msg, ctx)

    async def _on_error(self, msg: ErrorReply, ctx) -> None:
        self.errors[ctx.request_id] = msg


class TestHelperHeldCompiler(Service):
    """Test-only compiler stand-in: takes GrammarCompile and answers (the real compiler's answer) only
    once the test sets `release`, so a worker's grammar fetch stays under way as long as the test wants."""

    kind = "test_held_compiler"
    __test__ = False

    def __init__(self, config):
        super().__init__(config)
        self.compiler = ""
        self.asked = asyncio.Event()
        self.release = asyncio.Event()

    def handlers(self):
        return {GrammarCompile: self._on_compile}

    async def _on_compile(self, msg: GrammarCompile, ctx):
        self.asked.set()
        await self.release.wait()
        return (await self.call(self.compiler, msg, request_id=ctx.request_id, timeout=10)).message


class TestHelperHeldGrammars:
    """Test-only: wraps a worker's GrammarSource so that building a matcher waits until the test sets
    `release` (then the real build runs): a hand-off stays between its stream opening and its restore."""

    __test__ = False

    def __init__(self, source):
        self.source = source
        self.asked = asyncio.Event()
        self.release = asyncio.Event()

    async def state(self, *args, **kwargs):
        self.asked.set()
        await self.release.wait()
        return await self.source.state(*args, **kwargs)


class Stack(InProcessServices):
    tokenizer_id: str

    def ref(self, constraint: dict, compiler: Service | None = None, tokenizer: str = "") -> GrammarRef:
        """What the gateway computes (adapter/prepare.py): the key of this tokenizer and the canonical constraint."""
        spelled, tid = constraint_json(constraint), tokenizer or self.tokenizer_id
        return GrammarRef(constraint_key(tid, spelled), spelled, tid, (compiler or self.compiler).config.advertise)

    def request(self, prompt: list[int], sampling: SamplingParams, grammar: GrammarRef | None = None):
        return GenerateRequest(model="tiny", prompt_ids=prompt, sampling=sampling,
                               return_address=self.gw.config.advertise, grammar=grammar)

    async def finished(self, rid: str) -> tuple[list[int], GenerateChunk]:
        await eventually(lambda: self.gw.finished(rid), timeout=60, what=f"{rid} finished")
        return self.gw.tokens(rid), self.gw.chunks[rid][-1]

    async def refused(self, rid: str) -> ErrorReply:
        await eventually(lambda: rid in self.gw.errors, timeout=30, what=f"{rid} refused")
        return self.gw.errors[rid]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory, tiny_v41_model_dir):
    s = Stack(tmp_path_factory.mktemp("grammar-workers"))
    s.tokenizer_id = tokenizer_id(str(tiny_v41_model_dir / "tokenizer.json"))
    engine = {**engine_settings(tiny_v41_model_dir), "num_pages": 16, "max_num_seqs": 4, "batch_invariant": True}
    try:
        s.compiler = await s.start(GrammarCompilerService, "gc", {"model_dir": str(tiny_v41_model_dir),
                                                                  "processes": 1, "compile_timeout_s": 5.0})
        s.held = await s.start(TestHelperHeldCompiler, "held")
        s.held.compiler = s.compiler.config.advertise
        s.gw = await s.start(TestHelperGrammarGateway, "gw")
        s.unified = await s.start(UnifiedWorker, "unified", engine)
        s.decode = await s.start(DecodeWorker, "decode", engine)
        s.prefill = await s.start(PrefillWorker, "prefill", engine)
        yield s
    finally:
        await s.close()


def json_sampling(max_tokens: int = JSON_TOKENS) -> SamplingParams:
    return greedy_params(max_tokens, ignore_eos=False)


def assert_fits_schema(tokens: list[int], model_dir) -> None:
    text = load_grammar_tokenizer(model_dir / "tokenizer.json", VOCAB, EOS).decode_str(tokens)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def unified_runs(stack) -> dict[str, tuple[list[int], GenerateChunk]]:
    """The plain request alone, then again while a constrained one runs beside it (its grammar
    compiled first, as the gateway does, so the worker's fetch is a cache hit and it joins at once)."""
    s = stack
    ref = s.ref(json_schema(SCHEMA))
    await s.gw.call(s.compiler.config.advertise, GrammarCompile(ref.constraint, ref.tokenizer_id, ref.key), timeout=30)
    s.gw.send(s.unified.config.advertise, s.request(OTHER_PROMPT, greedy_params(PLAIN_TOKENS)), request_id="alone")
    runs = {"alone": await s.finished("alone")}
    s.gw.send(s.unified.config.advertise, s.request(OTHER_PROMPT, greedy_params(PLAIN_TOKENS)), request_id="plain")
    s.gw.send(s.unified.config.advertise, s.request(PROMPT, json_sampling(), ref), request_id="json")
    runs["plain"], runs["json"] = await s.finished("plain"), await s.finished("json")
    return runs


async def test_the_unified_worker_writes_valid_json_and_leaves_a_plain_neighbour_unchanged(
        stack, unified_runs, tiny_v41_model_dir):
    s = stack
    tokens, last = unified_runs["json"]
    assert last.finish_reason == int(FinishReason.STOP) and EOS not in tokens and len(tokens) < JSON_TOKENS
    assert_fits_schema(tokens, tiny_v41_model_dir)
    arrivals = s.gw.arrivals
    assert arrivals.index("json") < len(arrivals) - 1 - arrivals[::-1].index("plain")   # they shared steps
    assert unified_runs["plain"][0] == unified_runs["alone"][0] and len(unified_runs["plain"][0]) == PLAIN_TOKENS
    assert not s.unified.streams


async def test_a_resumed_constrained_attempt_ends_like_the_uninterrupted_run(stack, unified_runs):
    s = stack
    uninterrupted, _ = unified_runs["json"]
    first = s.request(PROMPT, json_sampling(), s.ref(json_schema(SCHEMA)))
    resumed = resumed_request(first, uninterrupted[:RESUME_AT], s.unified.model_id)
    assert resumed.grammar.replay == uninterrupted[:RESUME_AT] and resumed.sampling.step_offset == RESUME_AT
    assert resumed.sampling.max_tokens == JSON_TOKENS - RESUME_AT and resumed.exact_prefix
    s.gw.send(s.unified.config.advertise, resumed, request_id="json#r1")
    tokens, last = await s.finished("json#r1")
    assert tokens == uninterrupted[RESUME_AT:] and last.finish_reason == int(FinishReason.STOP)


async def test_a_hand_off_carries_the_grammar_and_the_decode_worker_continues_it(
        stack, unified_runs, tiny_v41_model_dir):
    s = stack
    request = s.request(PROMPT, json_sampling(), s.ref(json_schema(SCHEMA)))
    await s.gw.call(s.prefill.config.advertise, PrefillWork(request, 0, s.decode.config.advertise),
                    request_id="pd", timeout=60)
    tokens, last = await s.finished("pd")
    assert len(s.gw.chunks["pd"][0].token_ids) == 1   # the prefill worker's first token, then the decode worker's
    assert last.finish_reason == int(FinishReason.STOP)
    assert_fits_schema(tokens, tiny_v41_model_dir)
    assert tokens == unified_runs["json"][0]   # one engine or two, the same constrained output
    await engine_empty(s.prefill)
    assert not s.prefill.jobs and not s.decode.streams


async def test_a_constrained_hand_off_without_its_grammar_is_refused_and_frees_its_stream(stack):
    s = stack
    request = s.request(PROMPT, json_sampling(), s.ref(json_schema(SCHEMA)))
    with pytest.raises(RemoteError) as refused:
        await s.gw.call(s.decode.config.advertise, StateHandoff(request, KVSnapshot(), [], [5]),
                        request_id="no-grammar", timeout=30)
    assert refused.value.code == ErrorCode.INVALID_REQUEST and "carries no grammar" in refused.value.message
    assert not s.decode.streams and s.decode.in_flight() == 0
    await engine_empty(s.decode)
    assert "no-grammar" not in s.gw.chunks


async def test_a_refused_constraint_and_a_foreign_tokenizer_are_typed_errors_that_leave_no_stream(stack):
    s = stack
    not_schema = {"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}}
    s.gw.send(s.unified.config.advertise, s.request(PROMPT, json_sampling(), s.ref(json_schema(not_schema))),
              request_id="unsupported")
    unsupported = await s.refused("unsupported")
    assert unsupported.code == ErrorCode.GRAMMAR_UNSUPPORTED and "'not'" in unsupported.message

    foreign = s.ref(json_schema(SCHEMA), tokenizer="0123456789abcdef")
    s.gw.send(s.unified.config.advertise, s.request(PROMPT, json_sampling(), foreign), request_id="foreign")
    wrong = await s.refused("foreign")
    assert wrong.code == ErrorCode.INVALID_REQUEST and "0123456789abcdef" in wrong.message
    assert not s.unified.streams and s.unified.in_flight() == 0
    assert "unsupported" not in s.gw.chunks and "foreign" not in s.gw.chunks
    await engine_empty(s.unified)


async def test_an_abort_during_the_grammar_fetch_leaves_nothing_running(stack):
    s = stack
    request = s.request(PROMPT, json_sampling(400), s.ref(json_schema(LONG_STRING), compiler=s.held))
    s.gw.send(s.unified.config.advertise, request, request_id="held")
    await asyncio.wait_for(s.held.asked.wait(), timeout=30)   # the worker is fetching now
    assert "held" in s.unified.streams
    s.gw.send(s.unified.config.advertise, AbortRequest("client"), request_id="held")
    await eventually(lambda: "held" not in s.unified.streams, timeout=10, what="stream closed by the abort")
    s.held.release.set()
    await eventually(lambda: s.unified.in_flight() == 0, timeout=30, what="the GenerateRequest handler ended")
    assert await s.unified.engine(lambda engine: engine.request_ids()) == []
    assert "held" not in s.gw.chunks and "held" not in s.gw.errors


async def test_a_hand_off_aborted_while_its_matcher_is_built_is_not_restored(stack):
    s = stack
    held = s.decode.grammars = TestHelperHeldGrammars(s.decode.grammars)
    try:
        request = s.request(PROMPT, json_sampling(400), s.ref(json_schema(LONG_STRING)))
        work = asyncio.ensure_future(s.gw.call(s.prefill.config.advertise, PrefillWork(
            request, 0, s.decode.config.advertise), request_id="late", timeout=60))
        await asyncio.wait_for(held.asked.wait(), timeout=30)   # the state is at the decode worker, its stream open
        assert "late" in s.decode.streams
        s.gw.send(s.prefill.config.advertise, AbortRequest("client"), request_id="late")   # as the router does
        await eventually(lambda: "late" not in s.decode.streams, timeout=10, what="the abort reached the decode worker")
        held.release.set()
        with pytest.raises(RemoteError) as refused:
            await work
    finally:
        s.decode.grammars = held.source
    assert "aborted" in refused.value.message
    await eventually(lambda: s.decode.in_flight() == 0, timeout=30, what="the StateHandoff handler ended")
    assert await s.decode.engine(lambda engine: engine.request_ids()) == []
    await engine_empty(s.prefill)
    # the decode worker streamed nothing (its chunks name it); only the prefill's early first token came
    early = s.gw.chunks.get("late", [])
    assert not s.prefill.jobs and not any(c.worker for c in early) and [c.first_index for c in early] in ([], [0])
