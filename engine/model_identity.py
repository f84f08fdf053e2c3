"""The model identity that every block hash covers. No torch: the gateway computes it too."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path


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
    return f"{model_dir.name}-{dtype.removeprefix('torch.')}-{digest.hexdigest()}"


def configured_dtype(model_dir: str | Path) -> str:
    """The dtype a model directory declares (what an engine uses when none is asked for)."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    return str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16").removeprefix("torch.")
