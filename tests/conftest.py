"""Fixtures shared across the test tree."""
from __future__ import annotations

from pathlib import Path

import pytest

MODEL_NAME = "deepseek-v4-tiny"
V41_MODEL_NAME = "deepseek-v41-tiny"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny V4 model (real vocabulary, seed 0), written once per session; the V4 stack tests serve it."""
    from engine.models.v4.random_init import write_random_model_dir
    out = tmp_path_factory.mktemp("models") / MODEL_NAME
    write_random_model_dir("tiny", out, seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_v41_model_dir(tmp_path_factory) -> Path:
    """The default stack's model: `epd model init --arch v4.1` (tiny V4.1, released layout, seed 0)."""
    from engine.models.v41.random_init import write_random_v41_model_dir
    out = tmp_path_factory.mktemp("models41") / V41_MODEL_NAME
    write_random_v41_model_dir("tiny-v41", out, seed=0)
    return out


@pytest.fixture(scope="session")
def default_stack(tmp_path_factory, tiny_v41_model_dir):
    """The default topology (E/P/D) as real processes on the default model, started once per session
    (a start costs tens of seconds on a 2-core machine) and shared by the tests that only send it
    requests (tests/gateway, tests/workers). A test that kills or reshapes a stack starts its own."""
    from tests.helpers.test_helper_stack import down_stack, up_stack
    stack = up_stack(tmp_path_factory.mktemp("default_stack"), "default", tiny_v41_model_dir)
    yield stack
    down_stack(stack)
