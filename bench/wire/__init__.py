"""`epd bench wire`: the runtime transport vs raw pyzmq (command.py)."""
