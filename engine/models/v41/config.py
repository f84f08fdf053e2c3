"""DeepSeek V4.1 configuration: parse the released nested `config.json` (`model_type` `deepseek_v41`).

The file nests the text model under `text_config` and the vision tower under `vision_config`;
`V41Config` keeps the text model's fields flat, plus the few top-level ids the engine needs, and the
vision tower as a `V41VisionConfig` (`vision`; 0 layers: the checkpoint has no vision encoder).

Layer roles (CSA2): a layer with compress ratio 0 attends its 128-token window only. A compressed
layer reads the compressed KV of the nearest KV source at or before it (`kv_source_of`); a source
owns that KV and the indexer keys. Index sources that are not KV sources ("reindex") redo top-k with
their own queries against their source's keys; the rest ("reuse") take the last selection as is.
Layers after the candidate source select within its candidate blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine.models.common.config_file import read_config_dict
from engine.models.common.token_ids import parse_eos_ids, settle_eos_ids
from messages.images import VisionSizing

MODEL_TYPE = "deepseek_v41"

SWA, SOURCE, REINDEX, REUSE = "swa", "source", "reindex", "reuse"

_DEFAULT_YARN = {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                 "original_max_position_embeddings": 65536}


@dataclass(frozen=True, slots=True)
class V41VisionConfig:
    """The nested `vision_config`; defaults are the release's (NeMo `DeepseekV41VisionConfig`)."""

    num_layers: int = 32
    hidden_size: int = 1024
    num_heads: int = 16
    intermediate_size: int = 2816
    patch_size: int = 14
    rope_theta: float = 10000.0
    downsample_ratio: int = 3
    max_image_tokens: int = 1024
    min_pixels: int = 295936
    max_wh_ratio: float | None = None

    def __post_init__(self):
        if self.num_layers < 0:
            raise ValueError("vision num_hidden_layers must be >= 0")
        for name in ("hidden_size", "num_heads", "intermediate_size", "patch_size", "downsample_ratio",
                     "min_pixels"):
            if getattr(self, name) <= 0:
                raise ValueError(f"vision {name} must be positive")
        if self.max_image_tokens < 4:
            raise ValueError("vision max_image_tokens must be at least 4")
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ValueError("vision hidden_size / num_attention_heads must be a multiple of 4 (2D RoPE)")
        if not 0 < self.rope_theta < float("inf"):
            raise ValueError("vision rope_theta must be finite and positive")
        if self.max_wh_ratio is not None and not 1 <= self.max_wh_ratio < float("inf"):
            raise ValueError("vision max_wh_ratio must be None or at least 1")

    @property
    def enabled(self) -> bool:
        return self.num_layers > 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def sizing(self) -> VisionSizing:
        return VisionSizing(patch_size=self.patch_size, downsample_ratio=self.downsample_ratio,
                            max_image_tokens=self.max_image_tokens, min_pixels=self.min_pixels,
                            max_wh_ratio=self.max_wh_ratio)

    def to_dict(self) -> dict:
        """The released `vision_config` keys."""
        return {"model_type": "deepseek_v41_vision", "num_hidden_layers": self.num_layers,
                "hidden_size": self.hidden_size, "num_attention_heads": self.num_heads,
                "intermediate_size": self.intermediate_size, "patch_size": self.patch_size,
                "rope_theta": self.rope_theta, "downsample_ratio": self.downsample_ratio,
                "max_image_tokens": self.max_image_tokens, "min_pixels": self.min_pixels,
                "max_wh_ratio": self.max_wh_ratio}

    @classmethod
    def from_dict(cls, raw: dict) -> "V41VisionConfig":
        fields = {}
        for key, name, cast in _VISION_KEYS:
            if raw.get(key) is not None:
                fields[name] = cast(raw[key])
        return cls(**fields)


_VISION_KEYS = (
    ("num_hidden_layers", "num_layers", int), ("hidden_size", "hidden_size", int),
    ("num_attention_heads", "num_heads", int), ("intermediate_size", "intermediate_size", int),
    ("patch_size", "patch_size", int), ("rope_theta", "rope_theta", float),
    ("downsample_ratio", "downsample_ratio", int), ("max_image_tokens", "max_image_tokens", int),
    ("min_pixels", "min_pixels", int), ("max_wh_ratio", "max_wh_ratio", float),
)


@dataclass(frozen=True, slots=True)
class V41Config:
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
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True  # renormalise the chosen experts' scores to sum to 1 (top_k > 1)
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-20
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: dict = field(default_factory=lambda: dict(_DEFAULT_YARN))  # compressed layers only
    max_position_embeddings: int = 1048576
    sliding_window: int = 128
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer_id: int = -1  # -1: no candidate-block selection
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 99092
    num_nextn_predict_layers: int = 0  # DSpark layers (`mtp.*`): not loaded yet
    image_token_id: int = 129264
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    pad_token_id: int | None = 2
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    # built in code: no vision tower unless given one (a parsed config.json follows NeMo, see `_parse`)
    vision: V41VisionConfig = field(default_factory=lambda: V41VisionConfig(num_layers=0))
    eos_token_ids: tuple[int, ...] = ()  # every id that ends generation, eos_token_id first; () from eos_token_id

    def __post_init__(self):
        settle_eos_ids(self)
        n = self.num_layers
        if len(self.compress_ratios) != n:
            raise ValueError(f"compress_ratios covers {len(self.compress_ratios)} layers, need {n}")
        if self.num_heads * self.head_dim % self.o_groups or self.num_heads % self.o_groups:
            raise ValueError("num_heads must divide into o_groups")
        if self.rope_dim % 2 or not 0 < self.rope_dim <= min(self.head_dim, self.index_head_dim):
            raise ValueError(f"bad qk_rope_head_dim {self.rope_dim}")
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
            ids = getattr(self, name)
            if list(ids) != sorted(set(ids)) or any(not 0 <= i < n for i in ids):
                raise ValueError(f"{name} {list(ids)} must ascend within [0, {n})")
        if not set(self.kv_source_layer_ids) <= set(self.index_source_layer_ids):
            raise ValueError("every KV source must be an index source")
        owner = None
        for layer, ratio in enumerate(self.compress_ratios):
            if ratio == 0:
                if layer in self.index_source_layer_ids:
                    raise ValueError(f"SWA-only layer {layer} cannot be a KV or index source")
                continue
            if layer in self.kv_source_layer_ids:
                owner = layer
            if owner is None or self.compress_ratios[owner] != ratio:
                raise ValueError(f"compressed layer {layer} needs an earlier KV source of ratio {ratio}")
        if self.candidate_source_layer_id >= 0 and self.candidate_source_layer_id not in self.kv_source_layer_ids:
            raise ValueError("candidate_source_layer_id must be a KV source")
        if len(self.engram_layer_ids) != len(self.engram_num_embeddings):
            raise ValueError("engram_num_embeddings needs one row count per Engram layer")
        if self.scoring_func != "sqrtsoftplus":  # the reference routes with sqrtsoftplus whatever the field says
            raise ValueError(f"scoring_func {self.scoring_func!r}: V4.1 routes with 'sqrtsoftplus' only")
        if self.n_shared_experts != 1:
            raise ValueError(f"n_shared_experts {self.n_shared_experts}: V4.1 has exactly one shared expert")
        if self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings true: V4.1 has its own output head (the reference refuses ties too)")
        if self.dtype.removeprefix("torch.") not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype {self.dtype!r}: expected float32, bfloat16 or float16")

    # ---- layer roles
    def role(self, layer: int) -> str:
        if self.compress_ratios[layer] == 0:
            return SWA
        if layer in self.kv_source_layer_ids:
            return SOURCE
        return REINDEX if layer in self.index_source_layer_ids else REUSE

    def kv_source_of(self, layer: int) -> int:
        """The KV source whose compressed KV and indexer keys `layer` reads (-1: SWA-only layer)."""
        if self.compress_ratios[layer] == 0:
            return -1
        return max(s for s in self.kv_source_layer_ids if s <= layer)

    def uses_candidates(self, layer: int) -> bool:
        """Top-k of this layer is restricted to the candidate source's blocks."""
        return 0 <= self.candidate_source_layer_id < layer and self.compress_ratios[layer] > 0

    @property
    def last_kv_source(self) -> int:
        return max(self.kv_source_layer_ids, default=-1)

    # ---- the model contract (engine.models.spec.ModelConfigSpec); V4's ModelConfig answers the same questions
    def compress_ratio(self, layer: int) -> int:
        """Tokens per compressed entry this layer OWNS in the cache (0 unless it is a KV source)."""
        return self.compress_ratios[layer] if layer in self.kv_source_layer_ids else 0

    def owns_index_keys(self, layer: int) -> bool:
        return layer in self.kv_source_layer_ids

    def overlapping_tail(self, layer: int) -> bool:
        """V4.1 pools non-overlapping windows: a tail holds pending tokens only."""
        return False

    def has_index_tail(self, layer: int) -> bool:
        """V4.1 indexer keys come from the pooled latent, so the indexer keeps no tail of its own."""
        return False

    @property
    def supports_bounded_replay(self) -> bool:
        """Every ratio divides a 128-token block and no tail overlaps: at a block boundary the
        pages are the whole compressed state, so replaying the last block rebuilds the windows."""
        return all(128 % r == 0 for r in self.compress_ratios if r)

    @property
    def engram_context(self) -> int:
        """Earlier token ids an Engram n-gram hash looks back at (0 without Engram)."""
        return self.engram_max_ngram_size - 1 if self.engram_layer_ids else 0

    @property
    def quant_block(self) -> int:
        """The release's FP8 linears and MXFP4 experts scale 32x32 blocks."""
        return 32

    @property
    def unquantized_linears(self) -> tuple[str, ...]:
        return ("head", "weights_proj", "indexer.wk", "compressor.wkv", "compressor.wgate", "engram.wkv")

    @classmethod
    def from_dict(cls, raw: dict) -> "V41Config":
        return _parse(raw)


def is_v41(raw: dict) -> bool:
    """The gateway's rule too (services/gateway/model_dir.py): the model type names V4.1."""
    text = raw.get("text_config") or {}
    return raw.get("model_type") == MODEL_TYPE or text.get("model_type") == f"{MODEL_TYPE}_text"


def load_v41_config(name_or_path: str | Path | dict) -> V41Config:
    """A parsed dict, a bundled config name (`tiny-v41`), a JSON file, or a model directory."""
    return V41Config.from_dict(name_or_path if isinstance(name_or_path, dict) else read_config_dict(name_or_path))


# What the reference (NeMo's DeepseekV41TextConfig) takes when a required size is left out.
_REFERENCE_SIZES = {
    "vocab_size": 129280, "hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 64,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_groups": 8, "o_lora_rank": 1024,
    "moe_intermediate_size": 2304, "n_routed_experts": 384, "num_experts_per_tok": 6,
}
# The released checkpoint's quantization_config: FP8 e4m3 / MXFP4 with e8m0 (ue8m0) scales, 32x32 blocks.
_RELEASED_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [32, 32],
                          "expert_dtype": "fp4"}


def _parse(raw: dict) -> V41Config:
    text = dict(raw.get("text_config") or raw)
    _refuse_unsupported(raw, text)
    sizes = {key: int(text.get(key) if text.get(key) is not None else default)
             for key, default in _REFERENCE_SIZES.items()}
    n = sizes["num_hidden_layers"]
    ratios = text.get("compress_ratios") or [0, 0] + [2] * 18 + [1] * 20 + [0] * 3
    rope_scaling = text.get("rope_scaling")  # absent or null: the release's YaRN; {} turns it off, as in NeMo
    fields = {
        "vocab_size": sizes["vocab_size"],
        "hidden_size": sizes["hidden_size"],
        "num_layers": n,
        "num_heads": sizes["num_attention_heads"],
        "head_dim": sizes["head_dim"],
        "rope_dim": sizes["qk_rope_head_dim"],
        "q_lora_rank": sizes["q_lora_rank"],
        "o_groups": sizes["o_groups"],
        "o_lora_rank": sizes["o_lora_rank"],
        "moe_intermediate_size": sizes["moe_intermediate_size"],
        "n_routed_experts": sizes["n_routed_experts"],
        "experts_per_token": sizes["num_experts_per_tok"],
        "compress_ratios": tuple(int(r) for r in ratios[:n]),
        "kv_source_layer_ids": _ids(text.get("kv_source_layer_ids", [2, 8, 14, 20]), n),
        "index_source_layer_ids": _ids(text.get("index_source_layer_ids", [2, 8, 14, 20, 24, 28, 32, 36]), n),
        "rope_scaling": dict(_DEFAULT_YARN if rope_scaling is None else rope_scaling),
        "engram_layer_ids": tuple(int(i) for i in text.get("engram_layer_ids", [1, 14]) if int(i) < n),
    }
    engram_rows = text.get("engram_num_embeddings", [384006168, 384016682])
    all_engram = [int(i) for i in text.get("engram_layer_ids", [1, 14])]
    fields["engram_num_embeddings"] = tuple(int(r) for i, r in zip(all_engram, engram_rows) if i < n)
    if text.get("candidate_source_layer_id", 20) >= n:
        fields["candidate_source_layer_id"] = -1
    for key, cast in (
        ("n_shared_experts", int), ("scoring_func", str), ("norm_topk_prob", bool), ("routed_scaling_factor", float),
        ("swiglu_limit", float), ("rms_norm_eps", float), ("rope_theta", float),
        ("compress_rope_theta", float), ("max_position_embeddings", int), ("sliding_window", int),
        ("index_n_heads", int), ("index_head_dim", int), ("index_topk", int),
        ("candidate_source_layer_id", int), ("candidate_topk_blocks", int), ("candidate_block_size", int),
        ("hc_mult", int), ("hc_sinkhorn_iters", int), ("hc_eps", float), ("engram_max_ngram_size", int),
        ("engram_vocab_size", int), ("engram_n_heads", int), ("engram_head_dim", int),
        ("engram_pad_token_id", int), ("engram_compressed_vocab_size", int),
        ("num_nextn_predict_layers", int), ("tie_word_embeddings", bool),
    ):
        if key in text and key not in fields:
            fields[key] = cast(text[key])
    fields.setdefault("candidate_source_layer_id", 20 if n > 20 else -1)
    for key in ("image_token_id", "bos_token_id", "pad_token_id"):
        value = raw.get(key, text.get(key))
        if value is not None:
            fields[key] = _first(value)
    eos = raw.get("eos_token_id", text.get("eos_token_id"))
    if eos is not None:
        fields["eos_token_ids"] = parse_eos_ids(eos)
        fields["eos_token_id"] = fields["eos_token_ids"][0]
    # the text model's dtype, as the reference builds it (a top-level dtype alone does not set it)
    fields["dtype"] = str(text.get("dtype") or text.get("torch_dtype") or "bfloat16").removeprefix("torch.")
    fields["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings") or text.get("tie_word_embeddings"))
    # a missing vision_config is the release's tower, as in NeMo; {"num_hidden_layers": 0} turns it off
    fields["vision"] = V41VisionConfig.from_dict(raw.get("vision_config") or {})
    return V41Config(**fields)


def _refuse_unsupported(raw: dict, text: dict) -> None:
    """Fields the reference reads whose other values we do not implement: refused, naming the field."""
    if int(text.get("num_key_value_heads", 1)) != 1:
        raise ValueError(f"num_key_value_heads {text['num_key_value_heads']}: V4.1 attention shares one latent KV head")
    quantization = raw.get("quantization_config", text.get("quantization_config"))
    if quantization is None:  # a dequantized export: every weight is stored unquantized
        return
    if not isinstance(quantization, dict):
        raise ValueError(f"quantization_config must be an object, got {quantization!r}")
    for key, value in quantization.items():
        if key in _RELEASED_QUANTIZATION and value != _RELEASED_QUANTIZATION[key]:
            raise ValueError(f"quantization_config.{key} {value!r}: only the release's "
                             f"{_RELEASED_QUANTIZATION[key]!r} loads")


def _ids(ids, n: int) -> tuple[int, ...]:
    return tuple(int(i) for i in ids if int(i) < n)


def _first(value):
    return value[0] if isinstance(value, list) and value else value
