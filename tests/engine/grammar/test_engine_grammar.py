"""Structured output through the engine (tiny random V4.1, real vocabulary, CPU): the sampler only ever
sees the grammar's tokens, a finished grammar stops the request, the other rows of the batch are
untouched, the constraint can start after a token, a restored request continues the same, and
logprobs stay those of the unmasked distribution.

One mixed batch serves most checks; batch-invariant mode makes "the same as alone" exact."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
from llguidance import LLMatcher

from engine.engine_core import EngineConfig, EngineCore, EngineRequest
from engine.grammar import GrammarState, load_grammar_tokenizer
from engine.scheduler import Scheduler, Sequence
from messages.common import FinishReason, SamplingParams

try:
    import jsonschema
except ImportError:   # not a dependency: the structural check below stands alone
    jsonschema = None

VOCAB, EOS = 129280, 1
PROMPT = [0, 128803, 4, 17, 300, 5000, 128804]  # BOS <User> ... <Assistant>
OTHER_PROMPT = [0, 128803, 99, 1000, 128804]
NAMES = ("cat", "dog", "emu")
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["k", "n", "s"],
          "properties": {"k": {"enum": list(NAMES)}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "s": {"type": "string", "maxLength": 6}}}
STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
YES_NO = {"enum": ["yes", "no"]}
PLAIN_TOKENS = 4
RESUME_AT = 6
WITH_LOGPROBS = {"logprobs": True, "top_logprobs": 2}


@dataclass
class Run:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: FinishReason | None = None


def step(core: EngineCore, runs: dict[str, Run]) -> None:
    for out in core.step():
        run = runs.setdefault(out.request_id, Run())
        run.tokens += out.new_token_ids
        run.logprobs += out.logprobs
        run.top += out.top_logprobs
        run.finish_reason = out.finish_reason


@pytest.fixture(scope="module")
def core(tiny_v41_model_dir):
    return EngineCore(EngineConfig(model_dir=str(tiny_v41_model_dir), dtype="float32", num_pages=16,
                                   max_num_seqs=4, batch_invariant=True))


@pytest.fixture(scope="module")
def tokenizer(tiny_v41_model_dir):
    return load_grammar_tokenizer(tiny_v41_model_dir / "tokenizer.json", VOCAB, EOS)


def grammar_of(schema: dict) -> str:
    return LLMatcher.grammar_from_json_schema(schema, overrides=STYLE)


def plain_request(rid: str) -> EngineRequest:
    return EngineRequest(rid, PROMPT, SamplingParams(max_tokens=PLAIN_TOKENS, ignore_eos=True, **WITH_LOGPROBS))


def json_request(rid: str, tokenizer, prompt: list[int], sampling: SamplingParams, replay=()) -> EngineRequest:
    return EngineRequest(rid, prompt, sampling, grammar=GrammarState(tokenizer, grammar_of(SCHEMA), replay=replay))


def assert_fits_schema(text: str) -> None:
    value = json.loads(text)
    if jsonschema is not None:
        jsonschema.validate(value, SCHEMA)
    assert set(value) == {"k", "n", "s"}
    assert value["k"] in NAMES and isinstance(value["n"], int) and 0 <= value["n"] <= 99
    assert isinstance(value["s"], str) and len(value["s"]) <= 6


@pytest.fixture(scope="module")
def alone(core) -> Run:
    core.add_request(plain_request("plain-alone"))
    runs: dict[str, Run] = {}
    while core.has_unfinished():
        step(core, runs)
    return runs["plain-alone"]


@pytest.fixture(scope="module")
def mixed(core, tokenizer, alone) -> dict[str, Run]:
    """Greedy JSON, seeded JSON, the unconstrained request and a gated one in one batch; when the
    greedy one has RESUME_AT tokens, its snapshot is restored as a fifth request."""
    greedy = SamplingParams(max_tokens=64, **WITH_LOGPROBS)
    core.add_request(json_request("greedy", tokenizer, PROMPT, greedy))
    core.add_request(json_request("sampled", tokenizer, OTHER_PROMPT,
                                  SamplingParams(max_tokens=64, temperature=1.0, seed=7)))
    core.add_request(plain_request("plain"))
    core.add_request(EngineRequest("gated", PROMPT, SamplingParams(max_tokens=16),
                                   grammar=GrammarState(tokenizer, grammar_of(YES_NO), after_token=alone.tokens[1])))
    runs: dict[str, Run] = {}
    while core.has_unfinished():
        step(core, runs)
        if "resumed" not in runs and len(runs["greedy"].tokens) == RESUME_AT:
            snapshot, buffers = core.snapshot("greedy")
            generated = runs["greedy"].tokens[:]
            core.restore(json_request("resumed", tokenizer, PROMPT, greedy, replay=generated), snapshot, buffers,
                         generated_ids=generated)
            runs["resumed"] = Run(tokens=generated)
    return runs


@pytest.mark.parametrize("rid", ["greedy", "sampled"])
def test_a_json_schema_request_writes_valid_json_and_stops(mixed, tokenizer, rid):
    run = mixed[rid]
    assert run.finish_reason == FinishReason.STOP and EOS not in run.tokens   # the grammar's end stops it
    assert_fits_schema(tokenizer.decode_str(run.tokens))


def test_an_unconstrained_row_is_unaffected_by_its_batch(mixed, alone):
    assert len(alone.tokens) == PLAIN_TOKENS and alone.finish_reason == FinishReason.LENGTH
    assert mixed["plain"] == alone


def test_the_constraint_starts_after_the_after_token(mixed, alone, tokenizer):
    run = mixed["gated"]
    start = alone.tokens.index(alone.tokens[1]) + 1
    assert run.tokens[:start] == alone.tokens[:start]   # unconstrained: what the model writes anyway
    assert run.finish_reason == FinishReason.STOP
    assert json.loads(tokenizer.decode_str(run.tokens[start:])) in ("yes", "no")


def test_a_restored_request_continues_to_the_same_output(mixed):
    resumed, greedy = mixed["resumed"], mixed["greedy"]
    assert len(resumed.tokens) > RESUME_AT
    assert (resumed.tokens, resumed.finish_reason) == (greedy.tokens, greedy.finish_reason)


def test_logprobs_are_those_of_the_unmasked_distribution(mixed, alone):
    """Same prompt as the unconstrained run: the first step reports the model's own top tokens, and
    the grammar's choice (not the model's favourite) with its raw, lower log-probability."""
    greedy = mixed["greedy"]
    assert greedy.top[0] == alone.top[0]
    assert greedy.tokens[0] != alone.tokens[0] and greedy.logprobs[0] < alone.logprobs[0]
    assert len(greedy.logprobs) == len(greedy.tokens)


def test_a_rejected_token_is_an_error_and_a_complete_grammar_a_stop(tokenizer):
    """The scheduler's reading of the grammar after each sampled token (the mask makes a rejection a bug)."""
    seq = Sequence("r", [0], 1, SamplingParams(), "m", grammar=GrammarState(tokenizer, grammar_of(YES_NO)))
    assert Scheduler._grammar_reason(seq, tokenizer.tokenize_str("[")[0]) == FinishReason.ERROR
    yes = tokenizer.tokenize_str('"yes"')
    assert [Scheduler._grammar_reason(seq, t) for t in yes] == [None] * (len(yes) - 1) + [FinishReason.STOP]
