"""The prefix identity every service shares: one hash per full block, each covering everything before
it, fixed by its definition; the model identity it covers."""
from __future__ import annotations

import hashlib
import json
import struct

import pytest

from messages.prefix import BLOCK_TOKENS, HASH_BYTES, block_hashes, chain_hash, configured_dtype, model_identity


def test_one_hash_per_full_block_each_covering_everything_before_it():
    tokens = list(range(300))
    hashes = block_hashes("m", tokens)
    assert len(hashes) == 2 and all(len(h) == HASH_BYTES for h in hashes)
    assert hashes[1] == chain_hash(hashes[0], "m", tokens[128:256])
    changed_first = block_hashes("m", [999] + tokens[1:])
    assert changed_first[0] != hashes[0] and changed_first[1] != hashes[1]
    assert block_hashes("other-model", tokens) != hashes
    assert block_hashes("m", tokens[:256]) == hashes  # the partial third block is not hashed
    assert block_hashes("m", tokens + list(range(100)), previous=hashes) == block_hashes("m", tokens + list(range(100)))


def test_hash_is_fixed_by_its_definition():
    """blake2b-128 over (len(prev), prev, len(model id) u32 LE, model id, tokens as int32 LE)."""
    tokens = list(range(128))
    expected = hashlib.blake2b(b"\x00" + struct.pack("<I", 3) + b"abc" + struct.pack("<128i", *tokens), digest_size=16)
    assert block_hashes("abc", tokens) == [expected.digest()]
    with pytest.raises(ValueError, match="int32"):
        chain_hash(b"", "m", [2**31])


def test_blocks_are_128_tokens_unless_asked_otherwise():
    tokens = list(range(3 * BLOCK_TOKENS))
    assert BLOCK_TOKENS == 128 and len(block_hashes("m", tokens)) == 3
    assert len(block_hashes("m", tokens, block_tokens=64)) == 6
    with pytest.raises(ValueError, match="positive"):
        block_hashes("m", tokens, block_tokens=0)


def write_model(path, config: dict, weights: bytes = b"") -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    header = b'{"w": {}}'
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + weights)


def test_model_identity_names_the_weights_and_the_dtype(tmp_path):
    write_model(tmp_path / "a" / "tiny", {"dtype": "bfloat16"}, b"\x01" * 100)
    write_model(tmp_path / "b" / "tiny", {"dtype": "bfloat16"}, b"\x01" * 100)
    write_model(tmp_path / "c" / "tiny", {"dtype": "bfloat16"}, b"\x02" * 100)
    same = model_identity(tmp_path / "a" / "tiny", "bfloat16")
    assert same.startswith("tiny-bfloat16-") and same == model_identity(tmp_path / "b" / "tiny", "torch.bfloat16")
    assert model_identity(tmp_path / "c" / "tiny", "bfloat16") != same               # other weights
    assert model_identity(tmp_path / "a" / "tiny", "float32") != same                # other KV bytes


def test_configured_dtype_reads_the_config_and_defaults_to_bfloat16(tmp_path):
    write_model(tmp_path / "x", {"torch_dtype": "torch.float32"})
    write_model(tmp_path / "y", {})
    assert configured_dtype(tmp_path / "x") == "float32" and configured_dtype(tmp_path / "y") == "bfloat16"
