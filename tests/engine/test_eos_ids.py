"""A config's `eos_token_id` as a list (as Hugging Face configs often give it): generation ends on any id."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from engine.engine_core import EngineConfig, EngineCore, EngineRequest
from engine.models.common.config_file import read_config_dict
from engine.models.v4.config import ModelConfig
from engine.models.v41.config import load_v41_config
from engine.models.v41.random_init import released_config
from messages.common import FinishReason
from tests.engine.references import greedy_params, make_prompt, run_engine


@pytest.mark.parametrize("value, primary, ids", [(7, 7, (7,)), ([5, 9], 5, (5, 9)), ([4, 4, 2], 4, (4, 2)),
                                                 (None, None, ())])
def test_both_families_read_one_id_or_a_list(value, primary, ids):
    v4 = ModelConfig.from_dict({**read_config_dict("tiny"), "eos_token_id": value})
    v41 = load_v41_config({**read_config_dict("tiny-v41"), "eos_token_id": value})
    assert (v4.eos_token_id, v4.eos_token_ids) == (primary, ids)
    if value is not None:  # V4.1 keeps its default when the field is null, as before
        assert (v41.eos_token_id, v41.eos_token_ids) == (primary, ids)


@pytest.mark.parametrize("value", ["1", [], [3, "4"], [True], -1, [2.0]])
def test_a_bad_eos_token_id_is_refused_naming_the_field(value):
    with pytest.raises(ValueError, match="eos_token_id"):
        ModelConfig.from_dict({**read_config_dict("tiny"), "eos_token_id": value})
    with pytest.raises(ValueError, match="eos_token_id"):
        load_v41_config({**read_config_dict("tiny-v41"), "eos_token_id": value})


def test_a_config_built_in_code_takes_its_ids_from_eos_token_id_and_keeps_the_primary_first():
    raw = read_config_dict("tiny")
    base = ModelConfig.from_dict(raw)
    assert base.eos_token_ids == (base.eos_token_id,)
    with pytest.raises(ValueError, match="must be the first of eos_token_ids"):
        replace(base, eos_token_id=base.eos_token_id + 1)
    assert replace(base, eos_token_id=8, eos_token_ids=(8, 3)).eos_token_ids == (8, 3)


def test_the_v41_config_file_we_write_keeps_every_eos_id():
    raw = {**read_config_dict("tiny-v41"), "eos_token_id": [1, 6]}
    written = released_config(raw, load_v41_config(raw))
    assert written["eos_token_id"] == written["text_config"]["eos_token_id"] == [1, 6]
    assert load_v41_config(written).eos_token_ids == (1, 6)


def test_generation_stops_on_the_second_id_of_the_list(tiny_dir, greedy_alone, tmp_path):
    expected = greedy_alone(129)
    produced = expected[10]
    never = next(i for i in range(1000) if i not in expected)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for path in tiny_dir(0).iterdir():
        (model_dir / path.name).symlink_to(path)
    (model_dir / "config.json").unlink()
    config = json.loads((tiny_dir(0) / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "eos_token_id": [never, produced]}))
    engine = EngineCore(EngineConfig(model_dir=str(model_dir), dtype="float32"))
    assert engine.model.config.eos_token_id == never  # the primary id, for APIs that take one
    prompt = make_prompt(129, 0).tolist()
    engine.add_request(EngineRequest("eos", prompt, greedy_params(ignore_eos=False)))
    engine.add_request(EngineRequest("ignored", prompt, greedy_params(ignore_eos=True)))
    results = run_engine(engine)
    at = expected.index(produced)
    assert (results["eos"].tokens, results["eos"].finish_reason) == (expected[: at + 1], FinishReason.STOP)
    assert (results["ignored"].tokens, results["ignored"].finish_reason) == (expected, FinishReason.LENGTH)


def test_a_finished_grammar_allows_and_stops_on_every_eos_id(tiny_v41_model_dir):
    from llguidance import LLMatcher

    from engine.grammar import GrammarState, load_grammar_tokenizer

    vocab, ids = 129280, (1, 7)
    tokenizer = load_grammar_tokenizer(tiny_v41_model_dir / "tokenizer.json", vocab, ids)
    assert tokenizer is load_grammar_tokenizer(str(tiny_v41_model_dir / "tokenizer.json"), vocab, [1, 7])
    grammar = LLMatcher.grammar_from_json_schema({"type": "integer"})
    for eos in ids:
        state = GrammarState(tokenizer, grammar)
        assert all(state.accept(token) for token in tokenizer.tokenize_str("42"))
        row = torch.zeros(state.mask_words, dtype=torch.int32)
        state.fill(row)
        assert [bool(int(row[t // 32]) >> (t % 32) & 1) for t in (*ids, 9)] == [True, True, False]
        assert state.accept(eos) and state.done
    with pytest.raises(ValueError, match="at least one EOS id"):
        load_grammar_tokenizer(tiny_v41_model_dir / "tokenizer.json", vocab, ())
