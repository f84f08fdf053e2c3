"""`epd bench gateway`: the gateway adapter vs bare deepseek-recipe (command.py)."""
