"""transformers' DeepseekV4ForCausalLM built on the very tensors of our model, for `epd bench engine`.

hf_model_sharing builds it with its parameters on the meta device and hands it our state dict
(load_state_dict(assign=True): shared storage, copies only where HF keeps another dtype);
_cast_norms gives its RMSNorms weights in the model dtype where transformers 5.17 needs that.
"""
from __future__ import annotations

import re
from contextlib import contextmanager


def hf_model_sharing(model, raw: dict, config, device, dtype):
    """transformers' DeepseekV4ForCausalLM on `model`'s tensors.

    Built with its parameters on the meta device, then given our state dict with `assign=True`: each tensor whose dtype is
    the one `from_pretrained` would give that parameter is shared (same storage); the others (small:
    norms, hyper-connection and bias parameters where the two disagree) are copied. Buffers computed
    at construction (rotary tables) are moved to the device."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    from engine.models.v4.random_init import _hf_config
    hf_dict = _hf_config(dict(raw), config, dtype)
    hf_dict.pop("model_type", None)
    hf_config = DeepseekV4Config(**hf_dict)
    with _parameters_on_meta():
        hf = DeepseekV4ForCausalLM(hf_config)
    strict = getattr(DeepseekV4ForCausalLM, "_keep_in_fp32_modules_strict", None) or []
    fp32 = re.compile(r"((^|\.)(" + "|".join(map(re.escape, strict)) + r")($|\.))") if strict else None
    ours = model.state_dict()
    expected = hf.state_dict()
    if set(ours) != set(expected):
        raise RuntimeError(f"parameter names differ: ours only {sorted(set(ours) - set(expected))[:5]}, "
                           f"HF only {sorted(set(expected) - set(ours))[:5]}")
    tensors, stats = {}, {"shared": 0, "copied": 0, "shared_bytes": 0, "copied_bytes": 0, "copied_names": []}
    for name, meta in expected.items():
        src = ours[name]
        if tuple(src.shape) != tuple(meta.shape):
            raise RuntimeError(f"{name}: ours {tuple(src.shape)} vs HF {tuple(meta.shape)}")
        if src.is_floating_point():
            want = torch.float32 if fp32 is not None and fp32.search(name) else dtype
        else:
            want = meta.dtype
        nbytes = src.numel() * src.element_size()
        if src.dtype == want:
            tensors[name] = src
            stats["shared"] += 1
            stats["shared_bytes"] += nbytes
        else:
            tensors[name] = src.to(want)
            stats["copied"] += 1
            stats["copied_bytes"] += tensors[name].numel() * tensors[name].element_size()
            stats["copied_names"].append(name)
    hf.load_state_dict(tensors, strict=True, assign=True)
    hf.to(device)  # the buffers computed at construction (rotary tables); parameters are there already
    left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"HF tensors left on the meta device: {left[:5]}")
    stats["copied_names"] = stats["copied_names"][:12]
    hf.requires_grad_(False)
    return hf.eval(), stats


def _cast_norms(hf, dtype) -> list[str]:
    from torch import nn
    names = []
    for name, module in hf.named_modules():
        weight = getattr(module, "weight", None)
        if type(module).__name__.endswith("RMSNorm") and isinstance(weight, nn.Parameter) and weight.dtype != dtype:
            module.weight = nn.Parameter(weight.detach().to(dtype), requires_grad=False)
            names.append(name)
    return names


@contextmanager
def _parameters_on_meta():
    """Parameters created inside go to the meta device as they are registered (no memory, no init
    cost); buffers stay real, so tables computed at construction (rotary frequencies) survive."""
    from torch import nn
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None:
            moved = module._parameters[name]
            module._parameters[name] = type(moved)(moved.to("meta"), requires_grad=moved.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register
