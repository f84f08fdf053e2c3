"""Bounded replay on real processes (V4.1, the default model): a prefix whose window state has
expired everywhere is still a hit. The other prefill worker reads the pages from the KV store, finds
no window at L1 nor at L1 - 128, and its engine replays the last cached block (bounded replay), so the
request reports L1 - 128 cached tokens where V4 reports 0. Same stack as test_epd_reuse
(tests/helpers/test_helper_reuse_stack.py), serving the tiny V4.1."""
from __future__ import annotations

import pytest

from messages.prefix import BLOCK_TOKENS as BLOCK
from tests.helpers.test_helper_reuse_stack import Prompts, down, up
from tests.workers.test_epd_reuse import address_of, cached, chat, prefill_first, probe, shared_prefix_pair

pytestmark = pytest.mark.slow   # starts service processes


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_v41_model_dir):
    s = up(tmp_path_factory.mktemp("replay"), tiny_v41_model_dir)
    yield s
    down(s)


@pytest.fixture(scope="module")
def prompts(tiny_v41_model_dir):
    return Prompts(tiny_v41_model_dir)


def test_a_hit_whose_windows_expired_is_served_by_replaying_the_last_block(stack, prompts):
    short, long, hashes, l1 = shared_prefix_pair(prompts, seed=7)
    first = prefill_first(stack, short, "replay-a", hashes, l1 // BLOCK)
    holder = address_of(stack, first)
    # every window of the chain expires at the registry (as when their TTL ran out)
    for block_hash in hashes[: l1 // BLOCK]:
        stack.unregister(block_hash, holder)
    assert set(stack.holders(hashes[: l1 // BLOCK])) == {""}

    got = chat(stack, long, "replay-b")
    second, line = stack.prefilled_by("replay-b")
    assert second != first                                  # a worker that never held these windows
    assert probe(stack, "replay-b") == l1
    [imported] = stack.events(second, "prefix.imported", "replay-b")
    assert imported["blocks"] == l1 // BLOCK and not imported["with_state"]   # pages only, from the store
    assert cached(got) == line["hit_tokens"] == l1 - BLOCK > 0              # the last block replayed
    assert got.choices[0].finish_reason in ("stop", "length") and got.usage.completion_tokens > 0
