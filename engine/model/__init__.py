"""DeepSeek V4 in plain PyTorch, with explicit per-sequence state (see state.py)."""

from engine.model.config import ModelConfig, load_config
from engine.model.loader import load_model
from engine.model.model import DeepseekV4
from engine.model.state import SequenceState, join_state, split_state

__all__ = ["DeepseekV4", "ModelConfig", "SequenceState", "join_state", "load_config", "load_model", "split_state"]
