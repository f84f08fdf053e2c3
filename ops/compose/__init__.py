"""`epd compose`: a topology as a Docker Compose file (command.py)."""
