"""Stacks for the E/P/D worker tests: the default topology (E/P/D, shared with tests/gateway: see
tests/conftest.py) and the `unified` one, as real processes started by `epd up --detach --port-base N`
on the session's default model (tiny V4.1, random weights, real tokenizer). Named peers in the
topology move with the port base, so the embedded files run as they are."""
from __future__ import annotations

import pytest

from tests.helpers.test_helper_stack import down_stack, up_stack


@pytest.fixture(scope="session")
def epd_stack(default_stack):
    return default_stack


@pytest.fixture(scope="package")
def unified_stack(tmp_path_factory, tiny_v41_model_dir):
    stack = up_stack(tmp_path_factory.mktemp("unified"), "unified", tiny_v41_model_dir)
    yield stack
    down_stack(stack)
