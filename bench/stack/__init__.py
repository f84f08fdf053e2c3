"""`epd bench stack`: the E/P/D stack over HTTP vs the engine alone (command.py)."""
