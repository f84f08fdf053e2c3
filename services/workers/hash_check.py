"""The gateway computes the prompt's block hash chain; routing and the KV store trust it. A worker
whose model identity (model dir, dtype) differs would never hit a prefix: it says so, once."""
from __future__ import annotations

from messages.prefix import BLOCK_TOKENS, block_hashes as chain_of


class HashChainCheck:
    def __init__(self) -> None:
        self.warned = False

    def check(self, log, model_id: str, prompt_ids, block_hashes, images=()) -> bool:
        """True when the chain's first block hash is this worker's (or nothing to compare)."""
        if not block_hashes or len(prompt_ids) < BLOCK_TOKENS:
            return True
        if block_hashes[0] == chain_of(model_id, list(prompt_ids[:BLOCK_TOKENS]), images=images)[0]:
            return True
        if not self.warned:
            self.warned = True
            log.warning("hash_chain.mismatch", worker_model_id=model_id,
                        hint="the gateway's model_dir/dtype differ from this worker's: prefix hits will miss")
        return False
