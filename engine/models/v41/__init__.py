"""DeepSeek V4.1 text model (CSA2 attention, single-pass mHC, Engram) over explicit per-sequence state."""
