"""The inference engine: the DeepSeek V4 model (model/), paged per-request state (kv/), continuous
batching (scheduler/), sampling (sampling/), and EngineCore (engine_core.py), the API workers call."""
