"""How much of a prompt a prefill worker loads instead of computing (docs/design/serving.md, Hit length).

L1 is the block-KV hit from the KV store's index (a multiple of 128). The sliding-window state
is needed at the boundary where prefill resumes, so:
  1. the usable boundary is min(L1, cap), cap = L - 134 rounded down to a block boundary
     (128 SWA window + 6 tokens of speculative rollback slack), and never below 0: the "probe",
     which the prefill router routes with (swa_probe);
  2. if the window [probe - 128, probe] is found (the prefill worker's own, or a holder's through
     the SWA registry), the hit is the probe; otherwise the worker backs off one block:
     hit = probe - 128 (services/workers/prefix_load.py). A V4 worker needs the window there too,
     so it asks for both boundaries in its one fetch; a V4.1 worker (bounded replay)
     takes the pages up to the probe without any window and recomputes their last block, so its
     hit is probe - 128 whether or not L1 - 128's window exists: the same number either way.
All functions are pure; bad input raises ValueError.
"""
from __future__ import annotations

from messages.prefix import BLOCK_TOKENS   # block KV pages of 128 tokens
SWA_WINDOW = 128         # the SWA window covers the last 128 tokens
ROLLBACK_SLACK = 6       # L - 134 = 128 window + 6 tokens of speculative rollback


def _check(prompt_len: int, kv_hit_tokens: int = 0) -> None:
    if prompt_len < 0 or kv_hit_tokens < 0:
        raise ValueError(f"lengths must be >= 0 (prompt {prompt_len}, kv hit {kv_hit_tokens})")


def hit_cap(prompt_len: int) -> int:
    """The largest hit any prompt of this length may use: L - 134 rounded down to a block, >= 0."""
    _check(prompt_len)
    return max(0, prompt_len - SWA_WINDOW - ROLLBACK_SLACK) // BLOCK_TOKENS * BLOCK_TOKENS


def swa_probe(prompt_len: int, kv_hit_tokens: int) -> int:
    """The block boundary whose SWA window decides the hit: L1 (rounded down to a block) capped
    by `hit_cap`. 0 means there is nothing to load and nothing to look up."""
    _check(prompt_len, kv_hit_tokens)
    return min(kv_hit_tokens // BLOCK_TOKENS * BLOCK_TOKENS, hit_cap(prompt_len))


def hit_length(prompt_len: int, kv_hit_tokens: int, swa_at_probe: bool) -> int:
    """Tokens not computed: the probe when its SWA window is registered, else one block less (the
    L1 - 128 window, or for V4.1 a replay of the probe's last block)."""
    probe = swa_probe(prompt_len, kv_hit_tokens)
    if probe == 0 or swa_at_probe:
        return probe
    return probe - BLOCK_TOKENS
