"""`epd bench grammar`: llguidance vs xgrammar, engine steps with masks, TTFT under compile load (command.py)."""
