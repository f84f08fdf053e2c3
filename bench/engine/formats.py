"""`epd bench engine --weights released --kernels compare`: the release's weight formats and the
fused-kernel path against our torch path, in one run on the same weights.

  --weights released  routed experts MXFP4, linears FP8 (128x128 blocks in V4, 32x32 in V4.1), as
                      DeepSeek ships them. The torch path runs the same values dequantized
                      (`round_to_formats_`: plain modules on the formats' grids); the kernel path
                      holds them packed (`pack_model_`) and reads the packed bytes.
  --kernels compare   ours twice: impl "torch" (kernels off, plain weights) first, then impl "ours"
                      (kernels on, packed weights when --weights released). The table gains
                      `vs torch`; both paths' last-token logits on one prompt are compared.

The floors come from the bytes the engine actually holds: after packing, `held_bytes` counts the
packed data and scales (V4.1's `floor q` keeps the release's quantized caches on top).
"""
from __future__ import annotations

AGREEMENT_TOKENS = 64
BF16_RTOL = 1.6e-2  # torch.testing's bf16 tolerance, applied to the logits' largest magnitude


def held_bytes(model, weights: dict) -> dict:
    """`weights` (engine_weights / engine_weights_v41) with dense, routed and expert recounted
    from the tensors the model holds now (packed data and scales included)."""
    dense = routed = 0
    for name, t in model.state_dict().items():
        nbytes = t.numel() * t.element_size()
        if _is_routed(name):
            routed += nbytes
        elif not name.endswith(("embed_tokens.weight", "embed.weight")) and ".engram.embed." not in name:
            dense += nbytes
    experts = weights["moe_layers"] * model.config.n_routed_experts
    return {**weights, "dense": dense, "routed": routed, "expert": routed // experts}


def _is_routed(name: str) -> bool:
    """V4: mlp.experts.{gate_up,down}_proj, or their packed buffers; V4.1: ffn.experts.E.w*, or the
    MoE's packed buffers."""
    if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")) or ".ffn.experts." in name:
        return True
    return name.rsplit(".", 1)[-1] in ("gate_up_data", "gate_up_scale", "down_data", "down_scale")


def last_logits(model, prompt) -> "torch.Tensor":
    """fp32 logits of the last position of one prompt [T] on a fresh state."""
    import torch
    with torch.no_grad():  # not inference_mode: CUDA graphs captured here are replayed by the engine later
        return model([prompt.to(model.device)], [model.new_state()])[0].float()


def compare_logits(ours, reference) -> dict:
    """How far the kernel path's logits are from the torch path's on the same prompt."""
    scale = reference.abs().max().item()
    worst = (ours - reference).abs().max().item()
    top = ours.topk(5).indices.tolist(), reference.topk(5).indices.tolist()
    return {"prompt_tokens": AGREEMENT_TOKENS, "max_abs_err": round(worst, 5), "max_rel_err": round(worst / scale, 5),
            "within_bf16": worst <= BF16_RTOL * scale, "argmax_equal": top[0][0] == top[1][0],
            "top5_overlap": len(set(top[0]) & set(top[1]))}
