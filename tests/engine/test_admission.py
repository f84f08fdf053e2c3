"""EngineCore.admit (engine/admission.py): a cache hit's prefix import and its request in one
engine-thread call. The hit is as full as import_prefix then add_request made it; a refused import
still admits the request with what is usable; `ready` can leave the request out; a bad request
raises as add_request does."""
from __future__ import annotations

import pytest
import torch

from engine.admission import PrefixImport
from engine.engine_core import EngineRequest
from engine.models.v4.generate import greedy_generate
from tests.engine.references import greedy_params, make_prompt, run_engine
from tests.engine.test_disaggregation import boundary_over_the_wire, pages_over_the_wire, peer  # noqa: F401 - fixture


def second_prompt(prompt: list[int]) -> list[int]:
    return prompt[:256] + make_prompt(44, 12).tolist()   # shares the peer's two full blocks, then differs


def test_admit_imports_the_prefix_and_adds_the_request_for_a_full_hit(make_engine, tiny_model, peer):
    source, prompt, blocks, hashes = peer
    target = make_engine()
    header, buffers = boundary_over_the_wire(source.export_boundary_state(hashes[1]), target.model_id)
    second = second_prompt(prompt)
    admitted = target.admit(EngineRequest("b", second, greedy_params()),
                            PrefixImport(hashes[:2], pages_over_the_wire(blocks), (header, buffers)))
    assert (admitted.usable_tokens, admitted.import_error, admitted.added) == (256, "", True)
    assert target.request_ids() == ["b"]
    result = run_engine(target)["b"]
    assert result.last.num_cached_tokens == 256
    assert result.tokens == greedy_generate(tiny_model(0), torch.tensor(second), 64)


def test_a_refused_import_still_admits_the_request_with_what_is_usable(make_engine, tiny_model, peer):
    _, prompt, blocks, hashes = peer
    target = make_engine()
    second = second_prompt(prompt)
    wrong_dtype = [[page[0].double()] for _, page in blocks]
    admitted = target.admit(EngineRequest("b", second, greedy_params()), PrefixImport(hashes[:2], wrong_dtype))
    assert admitted.added and admitted.usable_tokens == 0 and "block 0" in admitted.import_error
    result = run_engine(target)["b"]
    assert result.last.num_cached_tokens == 0
    assert result.tokens == greedy_generate(tiny_model(0), torch.tensor(second), 64)


def test_ready_false_leaves_the_request_out_after_the_import(make_engine, peer):
    source, prompt, blocks, hashes = peer
    target = make_engine()
    seen = []
    admitted = target.admit(EngineRequest("b", second_prompt(prompt), greedy_params()),
                            PrefixImport(hashes[:2], [p for _, p in blocks], source.export_boundary_state(hashes[0])),
                            ready=lambda usable: seen.append(usable) or False)
    assert seen == [128] and (admitted.usable_tokens, admitted.added) == (128, False)
    assert target.request_ids() == [] and target.stats().pages_cached == 2   # imported, nothing added
    target.add_request(EngineRequest("b", second_prompt(prompt), greedy_params()))
    assert run_engine(target)["b"].last.num_cached_tokens == 128


def test_a_bad_request_raises_like_add_request_and_nothing_is_added(make_engine):
    engine = make_engine()
    with pytest.raises(ValueError, match="empty prompt"):
        engine.admit(EngineRequest("x", [], greedy_params()), prefill_only=True)
    assert engine.request_ids() == []


def test_admit_with_prefill_only_holds_the_state_after_the_first_token(make_engine):
    engine = make_engine()
    assert engine.admit(EngineRequest("p", make_prompt(200, 3).tolist(), greedy_params()), None, True).added
    outputs = engine.step()
    assert [(o.prefilled, len(o.new_token_ids)) for o in outputs] == [(True, 1)]
    assert engine.stats().num_held == 1 and not engine.has_unfinished()
