"""Prefix identity shared by every service: the model identity and the block hash chain.

A block is BLOCK_TOKENS tokens; engines page KV by it, the KV store keys pages by its hash, the
SWA registry and the routers count hits in it, the gateway hashes prompts with it.

hash_i = blake2b-128(hash_{i-1} | len(model_id) | model_id | block i's token ids as little-endian
int32 [| for each image overlapping the block: its start position and content digest]), with
hash_{-1} = b"". Every position of an image span has the same token id, so the ids alone cannot
tell two images apart: the digests can. Equal hashes mean equal model, equal tokens and equal
images from position 0 to the block's end, so a hash names a page of block KV anywhere: engine,
gateway, KV store. A prompt without images hashes exactly as before images existed.

Pure standard library on purpose: the gateway and the routers import this and must not load the engine.
"""
from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from pathlib import Path

BLOCK_TOKENS = 128
HASH_BYTES = 16
_INT32 = (-(2**31), 2**31 - 1)


def chain_hash(previous: bytes, model_id: str, block: Sequence[int],
               images: Sequence[tuple[int, bytes]] = ()) -> bytes:
    """The hash of one block given the hash of the block before it (b"" for the first block);
    `images`: (start position, digest) of each image overlapping the block."""
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
    for start, digest in images:
        h.update(struct.pack("<qB", start, len(digest)))
        h.update(digest)
    return h.digest()


def block_hashes(model_id: str, token_ids: Sequence[int], block_tokens: int = BLOCK_TOKENS,
                 previous: Sequence[bytes] = (), images: Sequence = ()) -> list[bytes]:
    """Hashes of every full block of `token_ids`. Pass the hashes already known as `previous`
    (a prefix of the answer) to hash only the blocks after them. `images`: the prompt's images
    (anything with `.start`, `.end` and `.digest`, e.g. messages.images.ImageInput)."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    hashes = list(previous)
    for start in range(len(hashes) * block_tokens, len(token_ids) - block_tokens + 1, block_tokens):
        end = start + block_tokens
        overlapping = [(image.start, image.digest) for image in images if image.start < end and image.end > start]
        hashes.append(chain_hash(hashes[-1] if hashes else b"", model_id, token_ids[start:end], overlapping))
    return hashes


def model_identity(model_dir: str | Path, dtype: str) -> str:
    """`<dir name>-<dtype>-<digest>`: the digest covers config.json and each weight file's name, size,
    header and first 64 KiB of tensor data, so engines on the same weights agree and different
    weights differ (without reading whole checkpoints). The dtype is part of it because KV pages
    of a bf16 engine and of an fp32 engine are different bytes."""
    model_dir = Path(model_dir)
    digest = hashlib.blake2b(digest_size=8)
    digest.update((model_dir / "config.json").read_bytes())
    for shard in sorted(model_dir.glob("*.safetensors")):
        digest.update(f"{shard.name}:{shard.stat().st_size}".encode())
        with shard.open("rb") as f:
            header = f.read(8)
            digest.update(header + f.read(int.from_bytes(header, "little") if len(header) == 8 else 0))
            digest.update(f.read(1 << 16))
    return f"{model_dir.name}-{dtype.rpartition('.')[2]}-{digest.hexdigest()}"   # (a dtype's module prefix dropped)


def configured_dtype(model_dir: str | Path) -> str:
    """The dtype a model directory declares (what an engine uses when none is asked for)."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    text = raw.get("text_config") or {}   # V4.1 nests the text model's config
    dtype = raw.get("dtype") or raw.get("torch_dtype") or text.get("dtype") or "bfloat16"
    return str(dtype).rpartition(".")[2]   # (older configs' key)   # (older configs' key)
