"""The floors of `epd bench engine` on a DeepSeek V4.1 config: two decode floors, one prefill floor.

decode, bytes a step must read / the device copy rate measured here (read + write counted), twice:
  today     what our engine holds: dense weights as loaded (quantized ones dequantized to the model
            dtype, fp32 where the release keeps fp32, the fp32 head included) + the expected distinct
            routed experts B tokens touch in every layer, N * (1 - (1 - k/N)^B), in the model dtype +
            the B sequences' KV state in the model dtype (every page byte of the KV sources: compressed
            entries and indexer keys; every layer's SWA window) + B embedding rows.
  released  the same reads in the release's formats (issue #15's target): the weights as stored
            (FP8 1 byte + e8m0 per 32x32 block, MXFP4 half a byte + e8m0 per 32, bf16/fp32 as is) and
            the caches in the release's formats (SWA KV fp8 + e8m0 per 32 channels; compressed KV
            nvfp4: e2m1 + an e4m3 scale per 16; indexer keys mxfp4: e2m1 + e8m0 per 32).
  Engram rows (FP8 + scales, from host memory over PCIe, B * 24 rows * 264 B per Engram layer) are
  reported apart, not in the device floor.
prefill: the active weights' matmul FLOPs (k routed experts, the head on the last token) / the bf16
matmul rate measured here (attention FLOPs left out: a lower bound). The same for both formats here.
"""
from __future__ import annotations

from bench.engine.plan import Cell


def kv_bytes(config, dtype_bytes: int) -> tuple[float, int]:
    """(bytes per token of the block KV, bytes of one sequence's SWA windows) as our engine stores them."""
    from engine.kv.page_pool import PageLayout
    layout = PageLayout.from_config(config, 128)
    return layout.page_numel * dtype_bytes / layout.block_size, \
        config.num_layers * config.sliding_window * config.head_dim * dtype_bytes


def released_kv_bytes(config) -> tuple[float, int]:
    """The same two sizes in the release's cache formats."""
    entry = config.head_dim // 2 + config.head_dim // 16           # nvfp4: e2m1 pairs + e4m3 per 16
    index_key = config.index_head_dim // 2 + config.index_head_dim // 32  # mxfp4: e2m1 pairs + e8m0 per 32
    per_token = sum((entry + index_key) / config.compress_ratio(layer) for layer in range(config.num_layers)
                    if config.compress_ratio(layer))
    swa_token = config.head_dim + config.head_dim // 32            # fp8 + e8m0 per 32 channels
    return per_token, config.num_layers * config.sliding_window * swa_token


def floor_row_v41(config, weights: dict, rates: dict, cell: Cell) -> dict:
    n, k, b = config.n_routed_experts, config.experts_per_token, cell.batch
    touched = n * (1 - (1 - k / n) ** b)
    rows = b * config.hidden_size * weights["dtype_bytes"]  # embedding rows (bf16 in the release too)
    per_token, swa = kv_bytes(config, weights["dtype_bytes"])
    kv = b * (cell.context * per_token + swa)
    today = weights["dense"] + weights["moe_layers"] * touched * weights["expert"] + kv + rows
    released = weights["released"]
    per_token_q, swa_q = released_kv_bytes(config)
    kv_q = b * (cell.context * per_token_q + swa_q)
    target = released["dense"] + weights["moe_layers"] * touched * released["expert"] + kv_q + rows
    engram_rows = (config.engram_max_ngram_size - 1) * config.engram_n_heads
    engram = b * len(config.engram_layer_ids) * engram_rows * config.engram_head_dim * (1 + 1 / 32)
    head = config.vocab_size * config.hidden_size
    prefill_flops = 2 * b * (cell.context * weights["active_params_per_token"] + head)
    rate = rates["copy_bytes_per_s"]
    return {"batch": b, "context": cell.context, "experts_touched_per_layer": round(touched, 1),
            "decode_bytes": int(today), "kv_bytes": int(kv), "kv_bytes_per_token": per_token,
            "decode_floor_ms": 1e3 * today / rate,
            "decode_bytes_released": int(target), "kv_bytes_released": int(kv_q),
            "decode_floor_ms_released": 1e3 * target / rate,
            "engram_host_bytes": int(engram),
            "prefill_flops": prefill_flops,
            "prefill_floor_tokens_per_s": b * cell.context / (prefill_flops / rates["matmul_flops_per_s"])}
