"""DeepSeek V4 in plain PyTorch, with explicit per-sequence state (see state.py)."""

from engine.models.common.state import SequenceState, join_state, split_state
from engine.models.v4.config import ModelConfig, load_config
from engine.models.v4.loader import load_model
from engine.models.v4.model import DeepseekV4

__all__ = ["DeepseekV4", "ModelConfig", "SequenceState", "join_state", "load_config", "load_model", "split_state"]
