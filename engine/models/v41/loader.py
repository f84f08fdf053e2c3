"""Load a V4.1 model directory into `DeepseekV41`: the released layout, or the forms
`engine.models.v41.checkpoint` lists (float32/bfloat16 storage, a dequantized BF16 export).

Quantized weights (FP8 32x32 blocks, MXFP4 experts) are dequantized at load, on every device for
now: the fused kernels that read them directly are issue #15's. The Engram tables stay FP8 in host
memory (pinned where CUDA is present) and are read by row; the n-gram hasher is built from the
directory's tokenizer.json, as the release requires. The vision tower's tensors (`vision.*`,
`aligner.*`, `image_*`) are skipped here: `engine.models.v41.vision.VisionEncoder.load` reads them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.models.common.dtypes import parse_dtype
from engine.models.v41.checkpoint import iter_v41_state_dict
from engine.models.v41.config import load_v41_config
from engine.models.v41.engram_hash import NgramHasher
from engine.models.v41.model import DeepseekV41, keeps_fp32

TABLE_MARK = ".engram.embed."  # `layers.L.engram.embed.weight` / `.scale`: the table, not a parameter


def load_v41_model(
    model_dir: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None
) -> DeepseekV41:
    model_dir = Path(model_dir)
    config = load_v41_config(model_dir)
    model_dtype = parse_dtype(dtype or config.dtype)
    with torch.device("meta"):
        model = DeepseekV41(config)
    state, tables = {}, {}
    for name, tensor in iter_v41_state_dict(model_dir, device, model_dtype, keep_engram_fp8=True):
        if TABLE_MARK in name:
            tables[name] = tensor
            continue
        if tensor.is_floating_point():
            tensor = tensor.to(device=device, dtype=torch.float32 if keeps_fp32(name) else model_dtype)
        state[name] = tensor
    model.load_state_dict(state, strict=True, assign=True)
    for index, block in enumerate(model.layers):
        if block.engram is not None:
            prefix = f"layers.{index}.engram.embed."
            block.engram.load_table(tables[prefix + "weight"], tables.get(prefix + "scale"))  # None: dequantized
    if config.engram_layer_ids:
        tokenizer = model_dir / "tokenizer.json"
        if not tokenizer.exists():
            raise FileNotFoundError(f"{model_dir} has Engram layers but no tokenizer.json to hash n-grams with")
        model.engram_hash = NgramHasher.from_tokenizer(config, tokenizer).to(device)
    return model.eval()
