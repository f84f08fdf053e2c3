"""Put a loaded model's weights into the release's quantized formats, in place.

DeepSeek ships V4-Flash and V4.1-Flash with MXFP4 routed experts and FP8 block-scaled linears
(128x128 blocks in V4, 32x32 in V4.1); the other weights (embeddings, the head, norms, mHC,
the router, fp32 compressor projections) stay as they are. `pack_model_` converts a model whose
weights were loaded (or drawn) in the model dtype: a weight that came from those formats is
re-quantized exactly (its blocks already hold representable values on the same grid).
`round_to_formats_` instead keeps the plain modules and rounds their weights onto the formats'
grids: the torch-path twin of a packed model (benchmarks and tests compare the two).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from engine.models.common.linear import GroupedLinear, linear_groups
from engine.models.spec import ModelSpec, PackableExperts
from engine.quant.packed import pack
from engine.quant.packed_linear import PackedLinear

EXPERT_FORMATS = ("bf16", "fp8", "mxfp4")
LINEAR_FORMATS = ("bf16", "fp8")

def pack_model_(model: ModelSpec, experts: str = "mxfp4", linears: str = "fp8") -> dict:
    """Pack `model` (either family: its config names the block and the linears kept plain) in place;
    returns what was packed."""
    block, done = _block(model, experts, linears), _summary(model, experts, linears)
    for module in _expert_modules(model, experts):
        module.pack_(experts, block)
        done["expert_layers"] += 1
    for parent, child_name, child in _linears(model, linears, block):
        setattr(parent, child_name, PackedLinear.from_linear(child, linears, block))
        done["linear_layers"] += 1
    return done


def round_to_formats_(model: ModelSpec, experts: str = "mxfp4", linears: str = "fp8") -> dict:
    """Round the weights `pack_model_` would pack onto their formats' grids, keeping plain modules."""
    block, done = _block(model, experts, linears), _summary(model, experts, linears)
    with torch.no_grad():
        for module in _expert_modules(model, experts):
            for param in module.expert_weights():
                param.copy_(pack(param, experts, block).dequantize(param.dtype))
            done["expert_layers"] += 1
        for _, _, child in _linears(model, linears, block):
            child.weight.copy_(pack(child.weight, linears, block).dequantize(child.weight.dtype))
            done["linear_layers"] += 1
    return done


def _block(model: ModelSpec, experts: str, linears: str) -> int:
    if experts not in EXPERT_FORMATS or linears not in LINEAR_FORMATS:
        raise ValueError(f"experts must be one of {EXPERT_FORMATS} and linears one of {LINEAR_FORMATS}, "
                         f"got {experts!r} / {linears!r}")
    return model.config.quant_block


def _summary(model: ModelSpec, experts: str, linears: str) -> dict:
    return {"experts": experts, "linears": linears, "block": model.config.quant_block,
            "expert_layers": 0, "linear_layers": 0}


def _expert_modules(model: ModelSpec, experts: str) -> list[PackableExperts]:
    """The routed-expert holders (V4 RoutedExperts, V4.1 MoE) with plain weights: they pack themselves."""
    if experts == "bf16":
        return []
    return [m for m in model.modules() if isinstance(m, PackableExperts) and m.expert_weights()]


def _linears(model: ModelSpec, linears: str, block: int) -> Iterator[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, linear) for every linear the release quantizes that sits on the block grid."""
    if linears == "bf16":
        return
    plain = model.config.unquantized_linears  # the release keeps these unquantized
    for name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) not in (nn.Linear, GroupedLinear) or full.endswith(plain):
                continue
            rows, columns = child.weight.shape
            if columns % block or (rows // linear_groups(child)) % block:
                continue  # not on the block grid (a group's rows included): kept as is
            yield parent, child_name, child
