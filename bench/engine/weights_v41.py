"""`epd bench engine` on a DeepSeek V4.1 config: random weights in the RELEASED formats, drawn on the
device and loaded through our own loader, plus the bytes the two decode floors count.

Weights: every tensor `engine.models.v41.checkpoint.released_tensor_specs` lists is drawn on `device` in the
format the release stores it (seeded by (seed, name)):
  FP8 32x32 / FP8 rows  e4m3 values ~ N(0, 96) (a block's largest lands in (224, 448], where the release's
                        power-of-two-ceil scales leave it; never 0) with e8m0 scales near
                        2**round(log2(std / 96)), jittered by one exponent either way;
  MXFP4                 random nibbles, never the two zero codes, with e8m0 scales likewise;
  BF16 / FP32           as `engine.models.v41.random_init.random_rows` draws them (sinks, biases randomised).
`engine.models.v41.loader.load_v41_model` then runs as it does on a model directory, with its file reader
(`iter_v41_state_dict`) swapped for these draws: quantized weights go through `dequantize_weight`
(engine.quant) to the model dtype, the Engram tables stay FP8 in host memory and are read by row,
and the n-gram hasher is built from the V4.1 tokenizer.json. No checkpoint is written.

Bytes (`v41_weight_bytes`): "today" is what our engine holds (quantized weights dequantized to the
model dtype, fp32 where the release keeps fp32); "released" is what the release stores (FP8 1 byte +
scales, MXFP4 half a byte + scales). Both leave out the embedding table and the Engram tables (a step
reads a few rows of each) and split the routed experts off the dense rest.
"""
from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

from bench.engine.device import _sync

FP8_VALUE_STD = 96.0
FP8_MAX = 448.0
FP8_FLOOR = 2.0**-6  # |value| below this becomes this: no zero element
NONZERO_NIBBLES = 14  # e2m1 codes without +0 (0) and -0 (8)
TABLE_CHUNK_ROWS = 1 << 20  # Engram table rows drawn per device chunk (then copied to host memory)
HF_NOT_RUN = "n/a: transformers has no DeepSeek V4.1 model (ours vs the floor only)"


def is_v41_raw(raw: dict) -> bool:
    from engine.models.v41.config import is_v41
    return is_v41(raw)


def with_layers(raw: dict, layers: int | None) -> dict:
    """The config with only its first `layers` decoder layers (the parser takes the released lists' prefix)."""
    if layers is None:
        return raw
    out = json.loads(json.dumps(raw))
    text = out.get("text_config") or out
    if not 1 <= layers <= int(text["num_hidden_layers"]):
        raise ValueError(f"--layers must be within [1, {text['num_hidden_layers']}], got {layers}")
    text["num_hidden_layers"] = layers
    return out


def write_v41_model_dir(raw: dict, config, out: Path) -> Path:
    """config.json (the released nested layout) and tokenizer.json: what the loader reads besides weights."""
    from engine.models.v41.random_init import released_config
    from engine.models.v41.tokenizer_file import write_v41_tokenizer
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(released_config(raw, config), indent=2) + "\n")
    write_v41_tokenizer(out)
    return out


def draw_v41_model(model_dir: Path, device, dtype, seed: int):
    """`load_v41_model(model_dir)` with every stored tensor drawn on `device` instead of read from a file."""
    import engine.models.v41.loader as loader
    from engine.models.v41.checkpoint import FP8_ROWS, FP32, dequantize_weight, released_tensor_specs, scale_name
    from engine.models.v41.config import load_v41_config

    if not callable(getattr(loader, "iter_v41_state_dict", None)):
        raise RuntimeError("engine.models.v41.loader no longer reads through iter_v41_state_dict: update this bench")

    def drawn(model_dir_arg, device_arg, dtype_arg, keep_engram_fp8: bool = False):
        config = load_v41_config(model_dir_arg)
        for name, spec in released_tensor_specs(config).items():
            stored = draw_stored(name, spec, device_arg, seed)
            if keep_engram_fp8 and spec.format == FP8_ROWS:
                yield name, stored[0]
                yield scale_name(name), stored[1]
            elif spec.quantized:
                yield name, dequantize_weight(spec, stored[0], stored[1], dtype_arg)
            else:
                yield name, stored[0] if spec.format == FP32 else stored[0].to(dtype_arg)

    original = loader.iter_v41_state_dict
    loader.iter_v41_state_dict = drawn
    try:
        model = loader.load_v41_model(model_dir, device, dtype)
    finally:
        loader.iter_v41_state_dict = original
    model.requires_grad_(False)
    _sync(device)
    return model


def draw_stored(name: str, spec, device, seed: int) -> list:
    """The tensors the release stores for one weight ([weight] or [weight, scale]), seeded by (seed, name).

    On `device`, except an Engram table (FP8 rows), which is drawn there chunk by chunk and lands in
    host memory, as the loader keeps it."""
    import torch
    from engine.models.v41.checkpoint import FP8, FP8_ROWS, MXFP4
    device = torch.device(device)
    if spec.format == FP8_ROWS:
        return _draw_table(name, spec, device, seed)
    g = _generator(device, seed, name)
    if spec.format == FP8:
        return [_fp8_values(spec.stored_shape, g, device), _scales(spec.scale_shape, spec, name, g, device)]
    if spec.format == MXFP4:
        return [_mxfp4_values(spec.stored_shape, g, device), _scales(spec.scale_shape, spec, name, g, device)]
    return [_plain(name, spec, g, device).to(spec.dtype)]


def _generator(device, seed: int, key: str):
    import torch
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))


def _fp8_values(shape, g, device):
    import torch
    x = torch.randn(shape, generator=g, device=device).mul_(FP8_VALUE_STD).clamp_(-FP8_MAX, FP8_MAX)
    return torch.where(x.abs() < FP8_FLOOR, FP8_FLOOR, x).to(torch.float8_e4m3fn)


def _mxfp4_values(shape, g, device):
    """int8 [rows, cols / 2]: two random non-zero e2m1 codes per byte."""
    import torch
    from engine.quant.mxfp4 import pack_nibbles
    rows, half = shape
    codes = torch.randint(0, NONZERO_NIBBLES, (rows, 2 * half), generator=g, device=device, dtype=torch.uint8)
    codes = codes + 1 + (codes >= 7).to(torch.uint8)  # 0..13 -> 1..7, 9..15
    return pack_nibbles(codes)


def _value_rms(spec) -> float:
    from engine.quant.mxfp4 import MAGNITUDES
    from engine.models.v41.checkpoint import MXFP4
    if spec.format == MXFP4:
        return math.sqrt(2 * sum(m * m for m in MAGNITUDES) / NONZERO_NIBBLES)
    return FP8_VALUE_STD


def _scales(shape, spec, name: str, g, device):
    """e8m0 scales: the exponent that brings the values to the weight's target std, +-1 at random."""
    import torch
    exponent = round(math.log2(_target_std(name, spec) / _value_rms(spec)))
    jitter = torch.randint(-1, 2, shape, generator=g, device=device, dtype=torch.int16)
    return (127 + exponent + jitter).clamp_(1, 254).to(torch.uint8).view(torch.float8_e8m0fnu)


def _target_std(name: str, spec) -> float:
    """The std `random_rows` gives the dequantized weight."""
    leaf = name.removesuffix(".weight").rsplit(".", 1)[-1]
    if name.endswith("engram.embed.weight"):
        return 1.0
    fan_in = spec.shape[-1]
    if ".experts." in name or ".shared_experts." in name:
        return (0.25 if leaf == "w2" else 4.0) / math.sqrt(fan_in)
    return 1.0 / math.sqrt(fan_in)


def _plain(name: str, spec, g, device):
    """A BF16 / FP32 weight, float32, drawn as `random_rows` draws it (nothing left at zero)."""
    import torch
    shape, leaf = spec.shape, name.removesuffix(".weight").rsplit(".", 1)[-1]
    normal = torch.randn(shape, generator=g, device=device)
    if leaf == "attn_sink" or leaf.endswith("_base"):
        return normal.mul_(0.5)
    if leaf.endswith("_scale"):
        return torch.rand(shape, generator=g, device=device).add_(0.5)
    if leaf in ("bias", "bias_vl"):
        return normal.mul_(0.1)
    if "norm" in leaf or leaf in ("q_weight", "k_weight"):
        return normal.mul_(0.1).add_(1.0)
    if name == "embed.weight":
        return normal
    return normal.div_(math.sqrt(shape[-1]))


def _draw_table(name: str, spec, device, seed: int) -> list:
    """An Engram table [rows, dim] FP8 + [rows, dim / 32] e8m0, drawn on `device` by chunks of rows
    (each from its own generator) into host memory."""
    import torch
    rows, dim = spec.shape
    values = torch.empty(spec.stored_shape, dtype=torch.uint8)
    scales = torch.empty(spec.scale_shape, dtype=torch.uint8)
    for begin in range(0, rows, TABLE_CHUNK_ROWS):
        end = min(rows, begin + TABLE_CHUNK_ROWS)
        g = _generator(device, seed, f"{name}#{begin // TABLE_CHUNK_ROWS}")
        values[begin:end].copy_(_fp8_values((end - begin, dim), g, device).view(torch.uint8))
        scales[begin:end].copy_(_scales((end - begin, spec.scale_shape[1]), spec, name, g, device).view(torch.uint8))
    return [values.view(torch.float8_e4m3fn), scales.view(torch.float8_e8m0fnu)]


# ---- bytes ------------------------------------------------------------------------------------

def _kind(name: str) -> str:
    if ".ffn.experts." in name:
        return "routed"
    if name == "embed.weight":
        return "embed"
    if ".engram.embed." in name:
        return "table"
    return "dense"


def v41_weight_bytes(model) -> dict:
    """Bytes as our engine holds the weights today and as the release stores them (see the module doc).

    `dense`/`expert` feed the floors: dense = all but the routed experts, the embedding and the
    Engram tables; expert = one routed expert of one layer (w1, w2, w3)."""
    from engine.models.v41.checkpoint import released_tensor_specs
    config = model.config
    today = {"total": 0, "dense": 0, "routed": 0, "embed": 0}
    for name, t in model.state_dict().items():
        nbytes = t.numel() * t.element_size()
        today["total"] += nbytes
        today[_kind(name)] += nbytes
    released = {"dense": 0, "routed": 0, "embed": 0, "table": 0}
    active = 0  # weight elements a token multiplies through: k of N routed experts, no embedding, no head
    for name, spec in released_tensor_specs(config).items():
        kind = _kind(name)
        released[kind] += sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in spec.stored(name))
        if len(spec.shape) == 2 and kind in ("dense", "routed") and name != "head.weight":
            n = math.prod(spec.shape)
            active += n * config.experts_per_token // config.n_routed_experts if kind == "routed" else n
    released["total"] = released["dense"] + released["routed"] + released["embed"]  # tables apart
    experts = config.num_layers * config.n_routed_experts
    tables = [block.engram.table for block in model.layers if block.engram is not None]
    return {**today, "expert": today["routed"] // experts, "moe_layers": config.num_layers,
            "active_params_per_token": active, "dtype_bytes": model.dtype.itemsize,
            "engram_table_host_bytes": sum(t.values.numel() + t.scales.numel() for t in tables),
            "engram_tables_pinned": all(t.pinned for t in tables) if tables else None,
            "released": {**released, "expert": released["routed"] // experts}}


def sanity_check(model, prompt) -> dict:
    """One forward over `prompt` [T] ids: are the logits finite, and how many distinct routed experts
    do its T tokens pick per layer (the floors assume N * (1 - (1 - k/N)^T), i.e. routing spread)."""
    import torch
    picked = []
    hooks = [block.ffn.gate.register_forward_hook(lambda module, args, out: picked.append(out[1]))
             for block in model.layers]
    try:
        with torch.inference_mode():
            logits = model([prompt.to(model.device)], [model.new_state()])[0].float()
    finally:
        for hook in hooks:
            hook.remove()
    n, k, t = model.config.n_routed_experts, model.config.experts_per_token, prompt.numel()
    return {"prompt_tokens": t, "logits_finite": bool(logits.isfinite().all()),
            "logits_std": round(logits.std().item(), 4), "argmax": int(logits.argmax()),
            "distinct_experts_per_layer": [int(p.unique().numel()) for p in picked],
            "distinct_experts_expected": round(n * (1 - (1 - k / n) ** t), 1)}
