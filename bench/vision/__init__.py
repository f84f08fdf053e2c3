"""`epd bench vision`: patch-aware vision balancing vs round robin and random (command.py)."""
