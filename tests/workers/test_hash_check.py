"""A worker compares the gateway's first block hash with its own model identity's."""
from __future__ import annotations

from messages.prefix import block_hashes
from services.workers.hash_check import HashChainCheck


class RecordingLog:
    def __init__(self):
        self.warnings = []

    def warning(self, event, **fields):
        self.warnings.append((event, fields))


PROMPT = list(range(300))


def test_a_matching_chain_passes_silently():
    log, check = RecordingLog(), HashChainCheck()
    assert check.check(log, "model-a", PROMPT, block_hashes("model-a", PROMPT))
    assert log.warnings == []


def test_another_model_identity_is_reported_once():
    log, check = RecordingLog(), HashChainCheck()
    theirs = block_hashes("model-b", PROMPT)
    assert not check.check(log, "model-a", PROMPT, theirs)
    assert not check.check(log, "model-a", PROMPT, theirs)
    assert [event for event, _ in log.warnings] == ["hash_chain.mismatch"]
    assert log.warnings[0][1]["worker_model_id"] == "model-a"


def test_short_prompts_and_missing_chains_are_not_compared():
    log, check = RecordingLog(), HashChainCheck()
    assert check.check(log, "model-a", PROMPT[:127], [b"x" * 32])
    assert check.check(log, "model-a", PROMPT, [])
    assert log.warnings == []
