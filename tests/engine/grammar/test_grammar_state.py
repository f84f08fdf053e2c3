"""GrammarState (llguidance matcher + late activation + rollback) and the batched bitmask: filled per
row from each row's own matcher, unpacked on the logits' device exactly as a per-token reading."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from llguidance import LLMatcher

from engine.grammar import GrammarError, GrammarState, build_matcher, load_grammar_tokenizer, tokenizer_id
from engine.grammar.mask import apply_token_bitmask_, fill_bitmasks

REPO = Path(__file__).resolve().parents[3]
VOCAB, EOS, THINK_END = 129280, 1, 128822
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["kind", "n"],
          "properties": {"kind": {"enum": ["cat", "dog"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANSWER = '{"kind": "dog", "n": 42}'


@pytest.fixture(scope="module")
def tokenizer(tiny_v41_model_dir):
    return load_grammar_tokenizer(tiny_v41_model_dir / "tokenizer.json", VOCAB, EOS)


@pytest.fixture(scope="module")
def grammar():
    return LLMatcher.grammar_from_json_schema(SCHEMA, overrides=STYLE)


@pytest.fixture(scope="module")
def answer(tokenizer):
    return tokenizer.tokenize_str(ANSWER)


def mask(state: GrammarState) -> torch.Tensor:
    row = torch.zeros(state.mask_words, dtype=torch.int32)
    state.fill(row)
    return row


def allowed(state: GrammarState) -> set[int]:
    """The tokens the state's mask allows (read with the unpacking checked against reference_unpack)."""
    logits = apply_token_bitmask_(torch.zeros(1, VOCAB), mask(state).view(1, -1))
    return set(logits[0].isfinite().nonzero().view(-1).tolist())


def reference_unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] bool, one token at a time: bit t % 32 of word t // 32 (absent words: banned)."""
    out = torch.zeros(bitmask.shape[0], vocab, dtype=torch.bool)
    words = bitmask.tolist()
    for r, row in enumerate(words):
        for t in range(min(vocab, 32 * len(row))):
            out[r, t] = bool((row[t // 32] >> (t % 32)) & 1)
    return out


def test_tokenizer_id_is_the_files_sha256_prefix_and_needs_no_torch(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_bytes(b'{"model": {}}')
    assert tokenizer_id(path) == hashlib.sha256(b'{"model": {}}').hexdigest()[:16]
    path.write_bytes(b'{"model": {"x": 1}}')
    assert tokenizer_id(path) != hashlib.sha256(b'{"model": {}}').hexdigest()[:16]
    probe = "import sys, engine.grammar; print(sorted({'torch', 'llguidance', 'transformers'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO)
    assert done.stdout.strip() == "[]", done.stderr


def test_the_grammar_tokenizer_is_built_once_per_process(tiny_v41_model_dir, tokenizer):
    again = load_grammar_tokenizer(str(tiny_v41_model_dir / "tokenizer.json"), VOCAB, EOS)
    assert again is tokenizer and tokenizer.vocab_size == VOCAB and tokenizer.eos_token == EOS


@pytest.mark.parametrize("vocab, words", [(1000, 32), (1000, 30), (96, 3)], ids=["ragged", "short-mask", "exact"])
def test_apply_matches_a_per_token_reading(vocab, words):
    gen = torch.Generator().manual_seed(vocab + words)
    bitmask = torch.randint(-2**31, 2**31, (3, words), dtype=torch.int32, generator=gen)
    bitmask[1] = -1   # all allowed
    bitmask[2, 0] = 0  # a whole word banned
    logits = torch.randn(3, vocab, generator=gen)
    expected = torch.where(reference_unpack(bitmask, vocab), logits, -torch.inf)
    assert torch.equal(apply_token_bitmask_(logits.clone(), bitmask), expected)
    assert torch.equal(apply_token_bitmask_(logits.clone().bfloat16(), bitmask), expected.bfloat16())


def test_a_bad_grammar_raises(tokenizer):
    with pytest.raises(GrammarError, match="does not build"):
        GrammarState(tokenizer, "start: ((")


def test_a_schema_answer_is_accepted_and_completes(tokenizer, grammar, answer):
    state = GrammarState(tokenizer, grammar)
    assert state.active and not state.done
    for token in answer[:-1]:
        assert token in allowed(state) and state.accept(token)
        assert not state.done
    assert state.accept(answer[-1]) and state.done and state.num_accepted == len(answer)
    assert allowed(state) == {EOS}


def test_a_rejected_token_leaves_the_state_usable(tokenizer, grammar, answer):
    state = GrammarState(tokenizer, grammar)
    wrong = tokenizer.tokenize_str("[")[0]
    assert wrong not in allowed(state)
    assert not state.accept(wrong) and state.num_accepted == 0
    assert all(state.accept(t) for t in answer) and state.done


def test_the_constraint_starts_after_the_after_token(tokenizer, grammar, answer):
    thinking = tokenizer.tokenize_str("hmm [no json here]")
    state = GrammarState(tokenizer, grammar, after_token=THINK_END)
    for token in thinking:
        assert not state.active and state.accept(token)
    assert state.accept(THINK_END) and state.active
    assert not state.accept(thinking[0])   # constrained now
    assert all(state.accept(t) for t in answer) and state.done
    assert state.num_accepted == len(thinking) + 1 + len(answer)


def test_replay_resumes_where_the_tokens_left_off(tokenizer, grammar, answer):
    fresh = GrammarState(tokenizer, grammar)
    for token in answer[:5]:
        fresh.accept(token)
    resumed = GrammarState(tokenizer, grammar, replay=answer[:5])
    assert resumed.num_accepted == 5 and torch.equal(mask(resumed), mask(fresh))
    gated = GrammarState(tokenizer, grammar, after_token=THINK_END, replay=[7, THINK_END, *answer[:3]])
    assert gated.active and gated.num_accepted == 5
    with pytest.raises(GrammarError, match="position 2"):
        GrammarState(tokenizer, grammar, replay=[answer[0], answer[1], tokenizer.tokenize_str("[")[0]])


def test_states_copied_from_one_template_are_independent(tokenizer, grammar, answer):
    template = build_matcher(tokenizer, grammar)
    first = GrammarState(tokenizer, grammar, template=template)
    second = GrammarState(tokenizer, grammar, template=template, replay=answer[:3])
    fresh = GrammarState(tokenizer, grammar)
    assert torch.equal(mask(first), mask(fresh))
    assert all(first.accept(t) for t in answer) and first.done
    assert second.num_accepted == 3 and not second.done
    assert torch.equal(mask(GrammarState(tokenizer, grammar, template=template)), mask(fresh))   # untouched
    with pytest.raises(GrammarError):
        build_matcher(tokenizer, "start: /[/")


def test_rollback_restores_the_masks_across_the_activation_point(tokenizer, grammar, answer):
    state = GrammarState(tokenizer, grammar, after_token=THINK_END)
    tokens = [5, THINK_END, *answer[:6]]
    masks = []
    for token in tokens:
        masks.append(mask(state) if state.active else None)
        assert state.accept(token)
    for n in (3, 7, 8):
        state.rollback(n)
        assert state.num_accepted == len(tokens) - n
        assert state.active == (len(tokens) - n >= 2)
        for i, token in enumerate(tokens[len(tokens) - n:], start=len(tokens) - n):
            if masks[i] is None:
                assert not state.active
            else:
                assert torch.equal(mask(state), masks[i])
            assert state.accept(token)
    with pytest.raises(ValueError):
        state.rollback(len(tokens) + 1)


def test_fill_bitmasks_gives_each_row_its_own_matcher_mask(tokenizer, grammar, answer):
    other = LLMatcher.grammar_from_json_schema({"type": "array", "items": {"type": "integer"}}, overrides=STYLE)
    states = [GrammarState(tokenizer, grammar, replay=answer[:2]), None,
              GrammarState(tokenizer, grammar, after_token=THINK_END), GrammarState(tokenizer, other)]
    batch = fill_bitmasks(states, VOCAB)
    assert batch.shape == (4, VOCAB // 32) and batch.dtype == torch.int32
    assert (batch[1] == -1).all() and (batch[2] == -1).all()   # unconstrained, not yet active
    for row in (0, 3):
        alone = fill_bitmasks([states[row]], VOCAB)   # the single-matcher path
        assert torch.equal(batch[row], alone[0])
        assert torch.equal(alone[0], mask(states[row]))
    assert not torch.equal(batch[0], batch[3])
    with pytest.raises(ValueError, match="another vocabulary size"):
        fill_bitmasks(states, VOCAB + 64)
