"""Fixtures shared across the test tree."""
from __future__ import annotations

from pathlib import Path

import pytest

MODEL_NAME = "deepseek-v4-tiny"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The default stack's model (tiny V4 shape, real vocabulary, seed 0), written once per session."""
    from engine.model.random_init import write_random_model_dir
    out = tmp_path_factory.mktemp("models") / MODEL_NAME
    write_random_model_dir("tiny", out, seed=0)
    return out
