"""`epd bench kv`: the KV store vs plain file I/O, prefix lookups at 1M blocks (command.py)."""
