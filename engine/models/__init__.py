"""The model families epd serves: `v4/` (DeepSeek V4) and `v41/` (DeepSeek V4.1), siblings behind one
contract (`spec.py`: what the engine may ask of a model and its config), sharing `common/`."""
