"""Seeded random weights for `epd bench engine`, drawn in place on the device, and their sizes."""
from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

from bench.engine.device import _sync


def draw_model(config, device, dtype, seed: int):
    """Our DeepseekV4 with every parameter and buffer drawn in place on `device`.

    Mirrors `engine.models.v4.random_init.random_tensor` (same scales, fp32 where the loader keeps fp32),
    but each tensor is filled on the device by a device generator seeded with (seed, name), so
    values differ from the CPU-written test checkpoints while never touching host memory.
    """
    import torch
    from engine.models.v4.loader import build_empty, tensor_dtype
    model = build_empty(config)
    values = {}
    for name, meta in model.state_dict().items():
        values[name] = draw_tensor(name, tuple(meta.shape), tensor_dtype(name, meta.dtype, dtype), config, device, seed)
    if config.tie_word_embeddings:
        values["lm_head.weight"] = values["model.embed_tokens.weight"]
    model.load_state_dict(values, strict=True, assign=True)
    model.requires_grad_(False)
    _sync(device)
    return model.eval()


def draw_tensor(name: str, shape: tuple, dtype, config, device, seed: int):
    import torch
    generator = torch.Generator(device=device)
    generator.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "tid2eid":
        scores = torch.rand(shape[0], config.n_routed_experts, generator=generator, device=device)
        return scores.argsort(dim=-1)[:, : shape[1]].to(dtype).contiguous()
    out = torch.empty(shape, dtype=dtype, device=device)
    if leaf in ("scale", "hc_scale"):
        return out.uniform_(0.5, 1.5, generator=generator)
    std, mean = _init_spec(name, leaf, shape)
    return out.normal_(mean, std, generator=generator)


def _init_spec(name: str, leaf: str, shape: tuple) -> tuple[float, float]:
    """(std, mean) as random_tensor draws them."""
    if leaf == "e_score_correction_bias":
        return 0.1, 0.0
    if leaf in ("sinks", "base", "hc_base", "position_bias"):
        return 0.5, 0.0
    if "norm" in name:
        return 0.1, 1.0
    if name.endswith("embed_tokens.weight"):
        return 1.0, 0.0
    if name.endswith("experts.gate_up_proj") or ("shared_experts" in name and "down_proj" not in name):
        return 4.0 / math.sqrt(shape[-1]), 0.0
    if name.endswith("experts.down_proj") or "shared_experts.down_proj" in name:
        return 0.25 / math.sqrt(shape[-1]), 0.0
    return 1.0 / math.sqrt(shape[-1]), 0.0


def weight_bytes(model) -> dict:
    """Total bytes; `dense` = what every decode step reads whatever the routing (all but the routed
    experts and the embedding table); `expert` = one routed expert of one layer."""
    config = model.config
    total = dense = routed = 0
    for name, t in model.state_dict().items():
        nbytes = t.numel() * t.element_size()
        total += nbytes
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            routed += nbytes
        elif not name.endswith("embed_tokens.weight"):
            dense += nbytes
    moe_layers = config.num_layers
    return {"total": total, "dense": dense, "routed": routed,
            "expert": routed // (moe_layers * config.n_routed_experts), "moe_layers": moe_layers,
            "active_params_per_token": _active_params(model)}


def _active_params(model) -> int:
    """Weight elements a token multiplies through (k routed experts, no embedding, no lm_head)."""
    config = model.config
    n = 0
    for name, t in model.state_dict().items():
        if not t.is_floating_point() or t.dim() < 2 or name.endswith(("embed_tokens.weight", "lm_head.weight")):
            continue
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            n += t.numel() // config.n_routed_experts * config.experts_per_token
        else:
            n += t.numel()
    return n


def write_config_dir(raw: dict, config, dtype, out: Path) -> Path:
    """A directory holding only config.json (the engine's model identity reads it; no weights)."""
    from engine.models.v4.random_init import _hf_config
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(_hf_config(dict(raw), config, dtype), indent=2) + "\n")
    return out
