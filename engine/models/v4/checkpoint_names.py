"""Checkpoint parameter names -> our module names.

Two layouts occur: the module names of transformers' DeepseekV4ForCausalLM (`model.layers.0.
self_attn.q_a_proj.weight`, stacked `mlp.experts.gate_up_proj`), which our modules mirror, and the
original DeepSeek names (`layers.0.attn.wq_a.weight`, per-expert `ffn.experts.3.w1.weight`), which
the released checkpoints use and transformers' `save_pretrained` writes back (with a `model.`
prefix on most keys). Both load.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOP_LEVEL = {
    "embed.weight": "model.embed_tokens.weight",
    "embed_tokens.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "lm_head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
    "hc_head.hc_fn": "model.hc_head.hc_fn",
    "hc_head.hc_base": "model.hc_head.hc_base",
    "hc_head.hc_scale": "model.hc_head.hc_scale",
}

# Applied in order to the part of a layer key after `layers.N.`; no-ops on our own names.
_LAYER_RENAMES = [
    (r"^attn\.", "self_attn."),
    (r"^ffn\.", "mlp."),
    (r"^attn_norm\.", "input_layernorm."),
    (r"^ffn_norm\.", "post_attention_layernorm."),
    (r"^hc_attn_(fn|base|scale)$", r"attn_hc.\1"),
    (r"^hc_ffn_(fn|base|scale)$", r"ffn_hc.\1"),
    (r"^self_attn\.attn_sink$", "self_attn.sinks"),
    (r"^self_attn\.indexer\.compressor\.", "self_attn.compressor.indexer."),
    (r"^self_attn\.indexer\.weights_proj\.", "self_attn.compressor.indexer.scorer.weights_proj."),
    (r"^self_attn\.indexer\.wq_b\.", "self_attn.compressor.indexer.q_b_proj."),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.wq_b\.", ".q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.norm\.weight$", ".kv_norm.weight"),
    (r"\.ape$", ".position_bias"),
    (r"^mlp\.gate\.bias$", "mlp.gate.e_score_correction_bias"),
    (r"^mlp\.shared_experts\.w1\.", "mlp.shared_experts.gate_proj."),
    (r"^mlp\.shared_experts\.w2\.", "mlp.shared_experts.down_proj."),
    (r"^mlp\.shared_experts\.w3\.", "mlp.shared_experts.up_proj."),
]
_LAYER_RENAMES = [(re.compile(pattern), replacement) for pattern, replacement in _LAYER_RENAMES]
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")
_EXPERT_KEY = re.compile(r"^mlp\.experts\.(\d+)\.(w1|w2|w3)\.weight$")


@dataclass(frozen=True, slots=True)
class ExpertPiece:
    """One expert's matrix from a per-expert checkpoint, to be placed into the stacked tensors.

    w1 (gate) and w3 (up) go to `gate_up_proj[expert]` rows [:I] and [I:]; w2 to `down_proj[expert]`.
    """

    layer: int
    expert: int
    kind: str  # "w1" | "w2" | "w3"

    @property
    def target(self) -> str:
        stacked = "down_proj" if self.kind == "w2" else "gate_up_proj"
        return f"model.layers.{self.layer}.mlp.experts.{stacked}"


def translate(name: str) -> str | ExpertPiece | None:
    """Our parameter name for a checkpoint key; an ExpertPiece; or None for keys we skip (MTP)."""
    if name.startswith(("mtp.", "model.mtp.")):
        return None
    bare = name.removeprefix("model.")
    if bare in _TOP_LEVEL:
        return _TOP_LEVEL[bare]
    match = _LAYER_KEY.match(bare)
    if match is None:
        return name
    layer, rest = int(match.group(1)), match.group(2)
    for pattern, replacement in _LAYER_RENAMES:
        rest = pattern.sub(replacement, rest)
    expert = _EXPERT_KEY.match(rest)
    if expert:
        return ExpertPiece(layer, int(expert.group(1)), expert.group(2))
    return f"model.layers.{layer}.{rest}"
