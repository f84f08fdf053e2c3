"""Per-request model state in preallocated memory.

- Block KV (CSA entries + indexer keys, HCA entries) lives in `num_pages` pages of 128 tokens
  (page_pool), reference-counted and shared through a prefix index of block hashes, LRU-evicted
  once unreferenced (block_manager; hashes from messages.prefix).
- The sliding window is a fixed ring per running sequence (swa.SwaSlots), and so are the
  compressor tails (tails.TailRings). paged_state.PagedState is the view attention uses for one
  sequence; decode_view.DecodeView reads and advances a whole decode batch with batched ops.
- Prefix hits and the window: pages alone cannot continue a sequence, so the window + tails at
  every 128-token boundary a sequence reaches (inside prefill chunks too, and while decoding)
  are saved in host memory keyed by that block's hash (swa.BoundaryCache, LRU by bytes). A hit
  is the longest chain of cached pages cut back to the last boundary with a saved state; it
  then continues exactly as the sequence that saved it would have. Saved states go when their
  page is evicted.
- manager.KVCache is what the scheduler talks to; snapshot turns a state into wire buffers.
"""
