"""A worker's settings: the engine's keys are checked with EngineConfig's types before anything starts."""
from __future__ import annotations

import typing

import pytest

from services.runtime.settings import parse_settings
from services.workers.settings import ENGINE_KEYS, WorkerSettings


def test_engine_keys_have_engine_config_types():
    from engine.engine_core import EngineConfig
    hints = typing.get_type_hints(EngineConfig)
    # EngineConfig's "int | None" is an int here: a topology leaves the key out for None
    unwrapped = {name: next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))
                 for name, hint in hints.items()}
    assert ENGINE_KEYS == unwrapped


@pytest.mark.parametrize("key, value", [("num_pages", "512"), ("cuda_graphs", 1), ("dtype", 16), ("max_model_len", 1.5)])
def test_an_engine_key_of_the_wrong_type_is_refused_naming_it(key, value):
    with pytest.raises(ValueError, match=f"prefill_worker: setting '{key}' must be a finite"):
        parse_settings(WorkerSettings, {key: value}, "prefill_worker")


def test_engine_keys_of_the_right_type_pass_to_the_engine():
    settings = parse_settings(WorkerSettings, {"num_pages": 64, "dtype": "bfloat16", "kv_writer": "tcp://x:1"}, "w")
    assert settings.engine == {"num_pages": 64, "dtype": "bfloat16"}
