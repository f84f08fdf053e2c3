"""Model configuration: parse a DeepSeek V4 `config.json` (HF layout, legacy keys included)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine.models.common.config_file import read_config_dict
from engine.models.common.token_ids import parse_eos_ids, settle_eos_ids

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
HASH_MOE = "hash_moe"
MOE = "moe"

_RATIO_TO_LAYER_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
_DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """One rotary flavour: plain RoPE, or YaRN-scaled when `rope_type == "yarn"`."""

    theta: float
    rope_type: str = "default"
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def __post_init__(self):
        if self.rope_type not in ("default", "yarn"):
            raise ValueError(f"unsupported rope_type {self.rope_type!r}")
        if self.rope_type == "yarn" and self.original_max_position_embeddings is None:
            raise ValueError("yarn rope needs original_max_position_embeddings")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Satisfies `engine.models.spec.ModelConfigSpec` (the questions below the fields)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    moe_intermediate_size: int
    n_routed_experts: int
    experts_per_token: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    main_rope: RopeSpec
    compress_rope: RopeSpec
    compress_rates: dict = field(default_factory=lambda: dict(_DEFAULT_COMPRESS_RATES))
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    sliding_window: int = 128
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    dtype: str = "bfloat16"
    eos_token_ids: tuple[int, ...] = ()  # every id that ends generation, eos_token_id first; () from eos_token_id

    def __post_init__(self):
        settle_eos_ids(self)
        for name, types, allowed in (
            ("layer_types", self.layer_types, (SLIDING, CSA, HCA)),
            ("mlp_layer_types", self.mlp_layer_types, (HASH_MOE, MOE)),
        ):
            if len(types) != self.num_layers:
                raise ValueError(f"len({name})={len(types)} != num_layers={self.num_layers}")
            bad = [t for t in types if t not in allowed]
            if bad:
                raise ValueError(f"{name} has unknown entries {bad}")
        if self.num_heads * self.head_dim % self.o_groups:
            raise ValueError("num_heads * head_dim must divide into o_groups")
        if self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim:
            raise ValueError(f"bad rope_dim {self.rope_dim}")
        if self.scoring_func not in ("sqrtsoftplus", "softmax", "sigmoid"):
            raise ValueError(f"unknown scoring_func {self.scoring_func!r}")
        for layer_type in (CSA, HCA):
            if layer_type in self.layer_types and layer_type not in self.compress_rates:
                raise ValueError(f"compress_rates lacks {layer_type}")

    def compress_ratio(self, layer: int) -> int:
        """Tokens per compressed entry of a layer (0 for sliding-only layers)."""
        layer_type = self.layer_types[layer]
        return 0 if layer_type == SLIDING else int(self.compress_rates[layer_type])

    # ---- the model contract (engine.models.spec.ModelConfigSpec); V41Config answers the same questions
    def owns_index_keys(self, layer: int) -> bool:
        return self.layer_types[layer] == CSA

    def overlapping_tail(self, layer: int) -> bool:
        """CSA pools overlapping windows: its tails keep the first half of the last full window."""
        return self.layer_types[layer] == CSA

    def has_index_tail(self, layer: int) -> bool:
        """The CSA indexer pools its own keys, so it keeps a tail of its own."""
        return self.layer_types[layer] == CSA

    @property
    def supports_bounded_replay(self) -> bool:
        """V4's CSA tails carry the overlap of the last window, which pages cannot rebuild."""
        return False

    @property
    def last_kv_source(self) -> int:
        """Every V4 layer reads only its own compressed KV: no trimmed replay."""
        return -1

    @property
    def engram_context(self) -> int:
        """V4 has no Engram: no earlier token ids are needed to continue a sequence."""
        return 0

    @property
    def image_token_id(self) -> None:
        """V4 is text-only."""
        return None

    @property
    def quant_block(self) -> int:
        """The release's FP8 linears scale 128x128 blocks."""
        return 128

    @property
    def unquantized_linears(self) -> tuple[str, ...]:
        return ("lm_head", "weights_proj")

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        return _parse(raw)


def load_config(name_or_path: str | Path) -> ModelConfig:
    """A bundled config name (`tiny`, `bench8`), a JSON file, or a model directory."""
    return ModelConfig.from_dict(read_config_dict(name_or_path))


# Fields transformers' DeepseekV4 reads whose other values we do not implement, with the one we do.
_ONLY_VALUE = {
    "hidden_act": ("silu", "the experts' activation is SiLU"),
    "mlp_bias": (False, "the expert projections have no bias"),
    "norm_topk_prob": (True, "the reference always renormalises the chosen experts' weights"),
}


def _refuse_unsupported(raw: dict) -> None:
    """A field we would otherwise ignore, set to a value we do not implement: refused, naming it."""
    for key, (value, why) in _ONLY_VALUE.items():
        if raw.get(key) is not None and raw[key] != value:
            raise ValueError(f"{key} {raw[key]!r} is not supported ({why}); only {value!r} loads")
    if raw.get("quantization_config") is not None:
        raise ValueError("quantization_config: quantized V4 checkpoints do not load; dequantize them to "
                         "bfloat16 or float32 and drop quantization_config")
    for alias, name in (("intermediate_size", "moe_intermediate_size"), ("num_local_experts", "n_routed_experts")):
        if raw.get(alias) is not None and raw.get(name) is not None and raw[alias] != raw[name]:
            raise ValueError(f"{alias} {raw[alias]} and {name} {raw[name]} disagree (transformers reads "
                             f"{alias} as {name})")


# transformers' DeepseekV4Config defaults for the sizes a config.json may leave out.
_REFERENCE_SIZES = {
    "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": 43,
    "num_attention_heads": 64, "head_dim": 512, "q_lora_rank": 1024, "num_experts_per_tok": 6,
    "n_routed_experts": 256, "o_groups": 8, "o_lora_rank": 1024,
}


def _parse(raw: dict) -> ModelConfig:
    _refuse_unsupported(raw)
    raw = {**raw, **{name: raw[alias] for alias, name in (("intermediate_size", "moe_intermediate_size"),
                                                          ("num_local_experts", "n_routed_experts"))
                     if raw.get(alias) is not None}}
    raw.update({key: value for key, value in _REFERENCE_SIZES.items() if raw.get(key) is None})
    num_layers = int(raw["num_hidden_layers"])
    head_dim = int(raw["head_dim"])
    eos_ids = parse_eos_ids(raw.get("eos_token_id", 1))
    compress_rates = dict(raw.get("compress_rates") or _DEFAULT_COMPRESS_RATES)
    if raw.get("compress_rate_csa") is not None:
        compress_rates[CSA] = int(raw["compress_rate_csa"])
    if raw.get("compress_rate_hca") is not None:
        compress_rates[HCA] = int(raw["compress_rate_hca"])
    partial = raw.get("partial_rotary_factor")
    if partial is not None:
        rope_dim = int(head_dim * partial)
    else:
        rope_dim = int(raw.get("qk_rope_head_dim", head_dim // 8))
    main_rope, compress_rope = _parse_rope(raw)
    return ModelConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        num_layers=num_layers,
        num_heads=int(raw["num_attention_heads"]),
        head_dim=head_dim,
        rope_dim=rope_dim,
        q_lora_rank=int(raw["q_lora_rank"]),
        o_groups=int(raw["o_groups"]),
        o_lora_rank=int(raw["o_lora_rank"]),
        moe_intermediate_size=int(raw["moe_intermediate_size"]),
        n_routed_experts=int(raw["n_routed_experts"]),
        experts_per_token=int(raw["num_experts_per_tok"]),
        layer_types=_layer_types(raw, num_layers),
        mlp_layer_types=_mlp_layer_types(raw, num_layers),
        main_rope=main_rope,
        compress_rope=compress_rope,
        compress_rates=compress_rates,
        n_shared_experts=int(raw.get("n_shared_experts", 1)),
        scoring_func=raw.get("scoring_func", "sqrtsoftplus"),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.5)),
        swiglu_limit=float(raw.get("swiglu_limit", 10.0)),
        index_n_heads=int(raw.get("index_n_heads", 64)),
        index_head_dim=int(raw.get("index_head_dim", 128)),
        index_topk=int(raw.get("index_topk", 512)),
        sliding_window=int(raw.get("sliding_window", 128)),
        hc_mult=int(raw.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(raw.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(raw.get("hc_eps", 1e-6)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 1048576)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id", 0),
        eos_token_id=eos_ids[0] if eos_ids else None,
        eos_token_ids=eos_ids,
        dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"),
    )


def _layer_types(raw: dict, num_layers: int) -> tuple[str, ...]:
    if raw.get("layer_types") is not None:
        return tuple(raw["layer_types"][:num_layers])
    if raw.get("compress_ratios") is not None:
        return tuple(_RATIO_TO_LAYER_TYPE[int(r)] for r in raw["compress_ratios"][:num_layers])
    raise ValueError("config needs explicit layer_types or compress_ratios")


def _mlp_layer_types(raw: dict, num_layers: int) -> tuple[str, ...]:
    if raw.get("mlp_layer_types") is not None:
        return tuple(raw["mlp_layer_types"][:num_layers])
    n_hash = min(num_layers, int(raw.get("num_hash_layers", 3)))
    return (HASH_MOE,) * n_hash + (MOE,) * (num_layers - n_hash)


def _parse_rope(raw: dict) -> tuple[RopeSpec, RopeSpec]:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        return _rope_spec(params["main"], raw.get("rope_theta", 10000.0)), _rope_spec(
            params["compress"], raw.get("compress_rope_theta", 160000.0)
        )
    main = RopeSpec(theta=float(raw.get("rope_theta", 10000.0)))
    compress = {k: v for k, v in params.items() if k not in ("main", "compress", "rope_theta")}
    compress.setdefault("rope_type", compress.pop("type", "default"))
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)  # V4 does not scale cos/sin on compressed layers
    return main, _rope_spec(compress, raw.get("compress_rope_theta", 160000.0))


def _rope_spec(params: dict, default_theta: float) -> RopeSpec:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return RopeSpec(theta=float(params.get("rope_theta", default_theta)))
    return RopeSpec(
        theta=float(params.get("rope_theta", default_theta)),
        rope_type=rope_type,
        factor=params.get("factor"),
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
    )
