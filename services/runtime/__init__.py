"""The actor shell every service runs in: sockets, lifecycle, membership, logs, metrics."""
