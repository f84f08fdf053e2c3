"""The prefix hash chain: one hash per full block of tokens, each covering everything before it.

hash_i = blake2b-128(hash_{i-1} | len(model_id) | model_id | block i's token ids as little-endian
int32), with hash_{-1} = b"". Equal hashes mean equal model and equal tokens from position 0 to
the block's end, so a hash names a page of block KV anywhere: engine, gateway, KV store.

Pure standard library on purpose: the gateway imports this module and must not load torch.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BLOCK_SIZE = 128
HASH_BYTES = 16
_INT32 = (-(2**31), 2**31 - 1)


def chain_hash(previous: bytes, model_id: str, block: Sequence[int]) -> bytes:
    """The hash of one block given the hash of the block before it (b"" for the first block)."""
    if not (0 <= len(previous) <= 64):
        raise ValueError(f"previous hash of {len(previous)} bytes")
    if block and not (_INT32[0] <= min(block) and max(block) <= _INT32[1]):
        raise ValueError("token ids must fit int32")
    name = model_id.encode()
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(bytes([len(previous)]))
    h.update(previous)
    h.update(struct.pack("<I", len(name)))
    h.update(name)
    h.update(struct.pack(f"<{len(block)}i", *block))
    return h.digest()


def block_hashes(
    model_id: str, token_ids: Sequence[int], block_size: int = BLOCK_SIZE, previous: Sequence[bytes] = ()
) -> list[bytes]:
    """Hashes of every full block of `token_ids`. Pass the hashes already known as `previous`
    (a prefix of the answer) to hash only the blocks after them."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes = list(previous)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        hashes.append(chain_hash(hashes[-1] if hashes else b"", model_id, token_ids[start : start + block_size]))
    return hashes
