"""Per served model: its prompt encoding, tokenizers and conversion options, built once."""
from __future__ import annotations

from dataclasses import dataclass

from deepseek_recipe import (
    ConversionOptions, DeepseekV41Encoding, DeepseekV4Encoding, ModelVersion, SpecialToken,
    SpecialTokens, Tokenizer,
)

from services.gateway.adapter.config import AdapterConfig, ServedModel
from services.gateway.adapter.detokenizer import TokenTable

_VERSION = {"v4": ModelVersion.DeepseekV4Pro, "v4.1": ModelVersion.DeepseekV41Flash}
_ENCODING = {"v4": DeepseekV4Encoding, "v4.1": DeepseekV41Encoding}


@dataclass(frozen=True, slots=True)
class ModelRuntime:
    served: ServedModel
    version: ModelVersion
    options: ConversionOptions        # accepts only this model's name
    encoding: object                  # DeepseekV4Encoding | DeepseekV41Encoding, tokenizer attached
    tokenizer: Tokenizer
    table: TokenTable
    eos_id: int


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
        limit = served.output_limit
        options = (ConversionOptions(default_thinking_mode=config.default_thinking)
                   .with_model_versions_by_name({served.name: version})
                   .with_thinking_max_tokens_upper_bound(limit)
                   .with_non_thinking_max_tokens_upper_bound(limit))
        runtimes[served.name] = ModelRuntime(
            served=served, version=version, options=options,
            encoding=_ENCODING[served.encoding]().with_tokenizer(tokenizer),
            tokenizer=tokenizer, table=table, eos_id=table.added_ids[eos])
    return runtimes
