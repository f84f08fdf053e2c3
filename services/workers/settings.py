"""A worker's settings (ServiceConfig.settings), apart from the worker so that `epd up` can check
them before it starts anything without importing torch."""
from __future__ import annotations

from dataclasses import dataclass

from services.runtime.settings import flat_keys, require_positive

# engine.engine_core.EngineConfig's fields and their types (a test keeps them equal); one that may be
# None there is given by its value's type here: a topology (TOML) has no null, it leaves the key out
ENGINE_KEYS = {"model_dir": str, "device": str, "dtype": str, "num_pages": int, "max_num_seqs": int,
               "max_batched_tokens": int, "enable_prefix_cache": bool, "batch_invariant": bool, "max_model_len": int,
               "swa_cache_bytes": int, "bounded_replay": bool, "replay_trim": bool, "cuda_graphs": bool,
               "torch_threads": int, "weights": str}


@dataclass(slots=True, frozen=True)
class WorkerSettings:
    engine: dict = flat_keys(ENGINE_KEYS)
    kv_writer: str = ""
    kv_store_dir: str = ""
    swa_registry: str = ""
    swa_ttl_s: float = 180.0
    handoff_timeout_s: float = 30.0
    fetch_timeout_s: float = 5.0
    grammar_timeout_s: float = 15.0   # a constraint's artifact from its compiler (which gives up at 10 s)
    vision_timeout_s: float = 30.0    # a request's image embeddings from one vision group (then one retry)
    capacity: int = 0

    def __post_init__(self) -> None:
        require_positive(self, "swa_ttl_s", "handoff_timeout_s", "fetch_timeout_s", "grammar_timeout_s",
                         "vision_timeout_s")
        if self.capacity < 0:
            raise ValueError("capacity must be >= 0")
