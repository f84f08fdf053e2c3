"""`epd bench engine`: EngineCore vs transformers DeepseekV4 vs the memory floor (command.py)."""
