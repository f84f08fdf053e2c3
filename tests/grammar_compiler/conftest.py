"""Fixtures of the grammar compiler tests: a model directory holding only tokenizer.json (all the
compiler reads), and the llguidance tokenizer built once per session (about a second)."""
from __future__ import annotations

import shutil

import pytest

from tests.grammar_compiler.test_helper_constraints import tokenizer_json


@pytest.fixture(scope="session")
def compiler_model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("grammar-model")
    shutil.copyfile(tokenizer_json(), out / "tokenizer.json")
    return out


@pytest.fixture(scope="session")
def llg_tokenizer():
    from services.grammar_compiler.check import load_tokenizer
    return load_tokenizer(tokenizer_json())
