"""Per served model: its prompt encoding, tokenizers and conversion options, built once.

V4.1 needs a tokenizer with V4.1's special tokens (the V4 one cannot encode `<｜System｜>`, which
opens every thinking-mode V4.1 prompt): a served V4.1 model whose tokenizer.json lacks them is an
error here, at start, not on the first request. V4.1 image placeholders are spelled
`<｜deepseek_image｜>` (deepseek-recipe's default `<｜image｜>` is another V4 token), so they encode
to the id V4.1's vision path keys on (recipe IMAGE_SPECIAL_TOKEN_ID, the config's image_token_id).
"""
from __future__ import annotations

from dataclasses import dataclass

from deepseek_recipe import (
    IMAGE_SPECIAL_TOKEN_ID, ConversionOptions, DeepseekV41Encoding, DeepseekV4Encoding,
    ModelVersion, SpecialToken, SpecialTokens, Tokenizer,
)

from services.gateway.adapter.config import AdapterConfig, ServedModel
from messages.grammar import tokenizer_id
from services.gateway.adapter.detokenizer import TokenTable

_VERSION = {"v4": ModelVersion.DeepseekV4Pro, "v4.1": ModelVersion.DeepseekV41Flash}
_ENCODING = {"v4": DeepseekV4Encoding, "v4.1": DeepseekV41Encoding}
V41_IMAGE_TOKEN = "<｜deepseek_image｜>"


@dataclass(frozen=True, slots=True)
class ModelRuntime:
    served: ServedModel
    version: ModelVersion
    options: ConversionOptions        # accepts only this model's name
    encoding: object                  # DeepseekV4Encoding | DeepseekV41Encoding, tokenizer attached
    tokenizer: Tokenizer
    table: TokenTable
    eos_id: int
    tokenizer_id: str = ""            # messages.grammar.tokenizer_id: grammar compiles are keyed by it
    image_token_id: int = IMAGE_SPECIAL_TOKEN_ID   # each image placeholder encodes to it (V4.1's image_token_id)


def load_models(config: AdapterConfig) -> dict[str, ModelRuntime]:
    """Load every tokenizer file once (about 0.3 s each) and build each model's runtime."""
    loaded: dict[str, tuple[Tokenizer, TokenTable]] = {}
    eos = SpecialTokens().token(SpecialToken.Eos)
    runtimes: dict[str, ModelRuntime] = {}
    for served in config.models:
        path = served.tokenizer_file
        if path not in loaded:
            loaded[path] = (Tokenizer.from_file(path), TokenTable.from_file(path))
        tokenizer, table = loaded[path]
        if eos not in table.added_ids:
            raise ValueError(f"{path} has no {eos} token")
        version = _VERSION[served.encoding]
        special = special_tokens_for(served.encoding, table, path)
        limit = served.output_limit
        options = (ConversionOptions(default_thinking_mode=config.default_thinking)
                   .with_model_versions_by_name({served.name: version})
                   .with_special_tokens(special)
                   .with_thinking_max_tokens_upper_bound(limit)
                   .with_non_thinking_max_tokens_upper_bound(limit))
        runtimes[served.name] = ModelRuntime(
            served=served, version=version, options=options,
            encoding=_ENCODING[served.encoding]().with_special_tokens(special).with_tokenizer(tokenizer),
            tokenizer=tokenizer, table=table, eos_id=table.added_ids[eos], tokenizer_id=tokenizer_id(path))
    return runtimes


def special_tokens_for(encoding: str, table: TokenTable, path: str) -> SpecialTokens:
    """The special-token spellings this encoding renders, checked against the tokenizer."""
    if encoding != "v4.1":
        return SpecialTokens()
    system = SpecialTokens().token(SpecialToken.System)
    missing = [t for t in (system, V41_IMAGE_TOKEN) if t not in table.added_ids]
    if missing:
        raise ValueError(f"{path} is not a V4.1 tokenizer (no {', '.join(missing)}); write one with "
                         f"engine.models.v41.tokenizer_file.write_v41_tokenizer (epd model init --arch v4.1)")
    if table.added_ids[V41_IMAGE_TOKEN] != IMAGE_SPECIAL_TOKEN_ID:
        raise ValueError(f"{path} gives {V41_IMAGE_TOKEN} id {table.added_ids[V41_IMAGE_TOKEN]}; "
                         f"V4.1 image inputs use id {IMAGE_SPECIAL_TOKEN_ID}")
    return SpecialTokens(image=V41_IMAGE_TOKEN)
