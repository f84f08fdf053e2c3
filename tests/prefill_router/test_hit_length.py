"""The hit-length rule: L1 with its SWA window, one block less without, never past L - 134."""
from __future__ import annotations

import pytest

from services.prefill_router.hit_length import (BLOCK_TOKENS, hit_cap, hit_length,
                                                swa_probe)


def reference(prompt_len: int, kv_hit: int, swa: bool) -> int:
    """The rule written the slow way: walk down from L1 to the first block boundary <= L - 134."""
    boundary = kv_hit - kv_hit % 128
    while boundary > 0 and boundary > prompt_len - 134:
        boundary -= 128
    if boundary <= 0:
        return 0
    return boundary if swa else boundary - 128


@pytest.mark.parametrize("prompt_len, kv_hit, swa, expected", [
    (1000, 512, True, 512),       # L1 with its SWA window
    (1000, 512, False, 384),      # no window: back off one block
    (1000, 128, True, 128),
    (1000, 128, False, 0),        # backing off the only block leaves nothing
    (1000, 0, True, 0),           # L1 = 0
    (1000, 0, False, 0),
    (1000, 896, True, 768),       # cap: 1000 - 134 = 866 -> 768
    (1000, 896, False, 640),      # cap, then no window at the capped boundary
    (1000, 100_000, True, 768),   # an index claiming more than the prompt is capped too
    (1030, 896, True, 896),       # 1030 - 134 = 896 exactly: allowed
    (1029, 896, True, 768),       # one token fewer: not
    (262, 256, True, 128),        # 262 - 134 = 128
    (261, 256, True, 0),          # 127 -> 0
    (134, 128, True, 0),
    (5, 0, True, 0),              # tiny prompts
    (1, 128, True, 0),
    (0, 0, False, 0),
    (1000, 600, True, 512),       # L1 off a block boundary is rounded down
])
def test_hit_length_cases(prompt_len, kv_hit, swa, expected):
    assert hit_length(prompt_len, kv_hit, swa) == expected


def test_hit_length_matches_the_rule_exhaustively():
    for prompt_len in range(0, 1300):
        cap = max(0, prompt_len - 134)
        for kv_hit in range(0, 1500, 32):
            for swa in (True, False):
                hit = hit_length(prompt_len, kv_hit, swa)
                assert hit == reference(prompt_len, kv_hit, swa), (prompt_len, kv_hit, swa)
                assert hit % BLOCK_TOKENS == 0 and 0 <= hit <= min(kv_hit, cap)
                probe = swa_probe(prompt_len, kv_hit)
                assert hit == (probe if swa or probe == 0 else probe - BLOCK_TOKENS)


def test_hit_cap_is_l_minus_134_rounded_down_to_a_block():
    assert [hit_cap(n) for n in (0, 133, 134, 261, 262, 389, 390, 10_134)] == [0, 0, 0, 0, 128, 128, 256, 9984]


def test_the_swa_probe_is_l1_unless_the_cap_cuts_it():
    assert swa_probe(10_000, 1280) == 1280
    assert swa_probe(1000, 1280) == 768
    assert swa_probe(1000, 0) == 0


def test_negative_lengths_are_refused():
    with pytest.raises(ValueError):
        hit_length(-1, 0, True)
    with pytest.raises(ValueError):
        hit_length(100, -128, True)
