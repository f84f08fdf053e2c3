"""Our V4.1 tokenizer.json (engine/models/v41/tokenizer_file.py): V4's with V4.1's special tokens renamed
in place, so ids, vocabulary size and Engram's compressed vocabulary stay what V4.1 expects."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from deepseek_recipe import IMAGE_SPECIAL_TOKEN_ID, SpecialToken, SpecialTokens

from engine.models.v41.tokenizer_file import (
    IMAGE_TOKEN, SYSTEM_TOKEN, V41_VOCAB_SIZE, v4_tokenizer_json, v41_tokenizer_dict, write_v41_tokenizer,
)

VLLM_ENCODER = Path("/work/refwheels/vllm/vllm/tokenizers/deepseek_v41_encoding.py")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    v4 = json.loads(v4_tokenizer_json().read_text(encoding="utf-8"))
    path = write_v41_tokenizer(tmp_path_factory.mktemp("tok"))
    return v4, json.loads(path.read_text(encoding="utf-8")), path


def test_only_two_added_tokens_change_and_the_vocabulary_stays_129280(files):
    v4, v41, _ = files
    rest = ("added_tokens",)
    assert {k: v for k, v in v41.items() if k not in rest} == {k: v for k, v in v4.items() if k not in rest}
    before = {t["id"]: t for t in v4["added_tokens"]}
    after = {t["id"]: t for t in v41["added_tokens"]}
    assert before.keys() == after.keys()
    changed = {i: (before[i]["content"], after[i]["content"]) for i in after if after[i] != before[i]}
    assert changed == {128000: ("<｜place▁holder▁no▁0｜>", SYSTEM_TOKEN), 129264: ("<｜image2｜>", IMAGE_TOKEN)}
    assert max([*v41["model"]["vocab"].values(), *after]) + 1 == V41_VOCAB_SIZE
    assert after[129264]["content"] == IMAGE_TOKEN and IMAGE_SPECIAL_TOKEN_ID == 129264
    assert after[128799]["content"] == "<｜place▁holder▁no▁799｜>"     # DSpark's noise token, untouched


def test_every_special_token_the_v41_encoders_use_is_one_token(files):
    _, v41, _ = files
    added = {t["content"] for t in v41["added_tokens"]}
    recipe = SpecialTokens(image=IMAGE_TOKEN)
    kinds = [getattr(SpecialToken, n) for n in dir(SpecialToken) if n[:1].isupper()]
    assert {recipe.token(k) for k in kinds} <= added
    if VLLM_ENCODER.exists():
        spec = importlib.util.spec_from_file_location("vllm_v41_encoding_reference", VLLM_ENCODER)
        ref = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ref)
        used = {ref.bos_token, ref.eos_token, ref.thinking_start_token, ref.thinking_end_token, ref.dsml_token,
                ref.USER_SP_TOKEN, ref.ASSISTANT_SP_TOKEN, ref.LATEST_REMINDER_SP_TOKEN, ref.IMAGE_PLACEHOLDER,
                ref.SYSTEM_SP_TOKEN, *ref.DS_TASK_SP_TOKENS.values()}
        assert used <= added, used - added


def test_engram_compressed_vocabulary_keeps_v41s_99092_keys(files):
    """Engram hashes V4.1's compressed ids (NFKC/NFD/accents/lowercase/whitespace normalised
    decoded tokens, config engram_compressed_vocab_size 99092): appending a token would change it."""
    tokenizers = pytest.importorskip("tokenizers", reason="the fast tokenizers package computes the keys")
    from tokenizers import Regex, normalizers as n
    _, _, path = files
    tok = tokenizers.Tokenizer.from_file(str(path))
    norm = n.Sequence([n.NFKC(), n.NFD(), n.StripAccents(), n.Lowercase(), n.Replace(Regex(r"[ \t\r\n]+"), " "),
                       n.Replace(Regex(r"^ $"), "\ue000"), n.Strip(), n.Replace("\ue000", " ")])
    keys: dict[str, list[int]] = {}
    for i in range(tok.get_vocab_size(with_added_tokens=True)):
        text = tok.decode([i], skip_special_tokens=False)
        key = tok.id_to_token(i) if "\ufffd" in text else (norm.normalize_str(text) or text)
        keys.setdefault(key, []).append(i)
    assert len(keys) == 99092
    assert keys["<|system|>"] == [128000] and keys["<|deepseek_image|>"] == [129264]


def test_writing_is_deterministic_and_leaves_no_temporary_file(files, tmp_path):
    _, _, first = files
    again = write_v41_tokenizer(tmp_path)
    assert again.read_bytes() == first.read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer.json"]


def test_a_tokenizer_that_is_not_v4_is_refused(files):
    v4, _, _ = files
    already = json.loads(json.dumps(v4))
    next(t for t in already["added_tokens"] if t["id"] == 129264)["content"] = "<｜other｜>"
    with pytest.raises(ValueError, match="expected '<｜image2｜>' at id 129264"):
        v41_tokenizer_dict(already)
