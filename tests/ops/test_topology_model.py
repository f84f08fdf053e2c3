"""The topology names the model once, in its [model] table: each service is handed the keys its kind
takes (the gateway and grammar compiler the directory, the engine workers dir, dtype and weights, the
vision worker dir and dtype). A service that names them again, or a bad [model] table, is an error
that says where the setting lives; `--model DIR` moves every service to DIR."""
from __future__ import annotations

import pytest

from ops.topology import load_topology, parse_topology
from services.gateway.service import GatewayService
from services.runtime.config import ServiceConfig

MODEL = {"dir": "/models/v41", "dtype": "bfloat16", "weights": "released"}


def services(*specs: dict, model: dict | None = None) -> dict:
    return {"model": MODEL if model is None else model, "service": list(specs)}


def model_settings(topology) -> dict[str, dict]:
    """kind -> the model keys of its settings (the launcher may add others, e.g. the gateway's aides)."""
    return {spec.kind: {k: v for k, v in config.settings.items() if k in ("model_dir", "dtype", "weights")}
            for spec, _, config in topology.instances()}


def test_each_kind_gets_the_model_keys_it_takes_and_no_others():
    topology = parse_topology(services(
        {"name": "gateway", "kind": "gateway", "upstream": "prefill", "settings": {"context_length": 4096}},
        {"name": "grammar", "kind": "grammar_compiler", "upstream": "gateway"},
        {"name": "router", "kind": "prefill_router"},
        {"name": "prefill", "kind": "prefill_worker", "upstream": "router", "settings": {"num_pages": 64}},
        {"name": "decode", "kind": "decode_worker"},
        {"name": "vision", "kind": "vision_worker"}))
    got = model_settings(topology)
    assert got["gateway"] == got["grammar_compiler"] == {"model_dir": "/models/v41"}
    assert got["prefill_router"] == {}
    engine = {"model_dir": "/models/v41", "dtype": "bfloat16", "weights": "released"}
    assert got["prefill_worker"] == got["decode_worker"] == engine
    assert topology.spec("prefill").options["settings"]["num_pages"] == 64   # its own settings stay
    assert got["vision_worker"] == {"model_dir": "/models/v41", "dtype": "bfloat16"}
    assert topology.model == MODEL


@pytest.mark.parametrize("kind,key", [("gateway", "dtype"), ("gateway", "model_dir"), ("prefill_worker", "weights"),
                                      ("decode_worker", "dtype"), ("vision_worker", "model_dir")])
def test_a_service_that_names_the_model_again_is_told_where_it_moved(kind, key):
    spec = {"name": "svc", "kind": kind, "settings": {key: "x"}}
    with pytest.raises(ValueError, match=rf"service svc: settings.{key} moved to the topology's \[model\] table"):
        parse_topology(services(spec))


@pytest.mark.parametrize("model,error", [
    ({"dir": "m", "dtpye": "float32"}, r"\[model\]: unknown keys \['dtpye'\]"),
    ({"dtype": "float32"}, r"\[model\] needs dir"),
    ({"dir": "m", "dtype": 16}, r"\[model\]: dtype must be a non-empty string"),
])
def test_a_bad_model_table_is_refused_naming_the_key(model, error):
    with pytest.raises(ValueError, match=error):
        parse_topology(services({"name": "w", "kind": "unified_worker"}, model=model))


def test_the_embedded_topologies_name_the_model_once_and_model_moves_every_service():
    for name in ("default", "unified", "gpu2"):
        topology = load_topology(name, model_dir="/elsewhere/my-model")
        dirs = {spec.name: config.settings.get("model_dir") for spec, _, config in topology.instances()}
        assert {d for d in dirs.values() if d} == {"/elsewhere/my-model"}, name
        gateway = next(c.settings for s, _, c in topology.instances() if s.kind == "gateway")
        assert gateway["served_model"] == "my-model" and "dtype" not in gateway


def test_a_gateway_dtype_setting_is_refused_it_learns_the_identity_from_the_workers():
    config = ServiceConfig(kind="gateway", instance="gw", bind="ipc:///tmp/unused.sock", upstream="ipc:///tmp/up.sock",
                           settings={"dtype": "float32"})
    with pytest.raises(ValueError, match="settings.dtype is gone: the gateway learns the model identity"):
        GatewayService(config)
