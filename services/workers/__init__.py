"""GPU worker services: thin shells around `engine/`: `unified` (prefill and decode in one process), `prefill` and `decode` (the E/P/D pools; vision later)."""
