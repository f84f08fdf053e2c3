"""The inference engine: the DeepSeek V4 model and (later) its scheduler and paged state."""
