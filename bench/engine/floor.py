"""The memory floor of `epd bench engine`: the least time a decode step or a prefill could take here.

decode: the bytes a step must read (dense weights + the expected distinct routed experts B tokens
touch in every MoE layer, N * (1 - (1 - k/N)^B) + the block KV and SWA windows of the B sequences)
/ the device copy rate measured here (read + write counted). prefill: the active weights' matmul
FLOPs / the matmul rate measured here (attention FLOPs left out: a lower bound).
"""
from __future__ import annotations

from bench.engine.plan import Cell


def floor_row(config, model, weights: dict, rates: dict, cell: Cell) -> dict:
    from engine.kv.page_pool import PageLayout
    n, k = config.n_routed_experts, config.experts_per_token
    touched = n * (1 - (1 - k / n) ** cell.batch)
    layout = PageLayout.from_config(config, 128)
    dtype_bytes = model.model.embed_tokens.weight.element_size()
    kv_per_token = layout.page_numel * dtype_bytes / layout.block_size
    swa_per_seq = config.num_layers * config.sliding_window * config.head_dim * dtype_bytes
    kv = cell.batch * (cell.context * kv_per_token + swa_per_seq)
    experts = weights["moe_layers"] * touched * weights["expert"]
    decode_bytes = weights["dense"] + experts + kv
    lm_head = config.vocab_size * config.hidden_size
    prefill_flops = 2 * cell.batch * (cell.context * weights["active_params_per_token"] + lm_head)
    return {"batch": cell.batch, "context": cell.context, "experts_touched_per_layer": round(touched, 1),
            "decode_bytes": int(decode_bytes), "kv_bytes": int(kv), "kv_bytes_per_token": kv_per_token,
            "decode_floor_ms": 1e3 * decode_bytes / rates["copy_bytes_per_s"],
            "prefill_flops": prefill_flops,
            "prefill_floor_tokens_per_s": cell.batch * cell.context / (prefill_flops / rates["matmul_flops_per_s"])}
