"""ops/topologies/default.toml, the E/P/D form: every peer a service reaches is named, not addressed,
and resolves to that service's address wherever the stack listens; the wiring is the E/P/D one and
every service's settings parse."""
from __future__ import annotations

import tomllib
from importlib import resources

import pytest

from ops.topology import load_topology, parse_topology
from services.catalog import resolve
from services.prefill_router.settings import PrefillRouterSettings
from services.runtime.settings import parse_settings
from services.workers.engine_worker import ENGINE_KEYS, WorkerSettings

# settings key -> the service it must name, for every service that has the key
PEER_KEYS = {"kv_writer": "kv_writer", "swa_registry": "swa_registry", "decode_router": "decode_router"}


@pytest.mark.parametrize("port_base", [None, 31000])
def test_every_peer_setting_names_its_service_and_resolves_to_its_address(port_base):
    topology = load_topology("default", port_base=port_base)
    address = {spec.name: config.bind for spec, replica, config in topology.instances() if replica == 0}
    for spec, _, config in topology.instances():
        written = spec.options.get("settings", {})
        for key, target in PEER_KEYS.items():
            if key in written:
                assert written[key] == "@" + target, f"{spec.name}.{key} must name the service"
                assert config.settings[key] == address[target], f"{spec.name}.{key}"
    if port_base is not None:
        assert address["kv_writer"] == f"tcp://127.0.0.1:{port_base + 6}"
    router = topology.spec("prefill_router").options["settings"]
    assert "decode_router" in router and router["kv_store_dir"] == topology.spec("kv_writer").options["settings"]["root"]
    for worker in ("prefill_worker", "decode_worker"):
        assert set(topology.spec(worker).options["settings"]) >= {"kv_writer", "swa_registry"}


def test_the_stack_is_wired_the_epd_way_and_every_setting_parses():
    topology = load_topology("default")
    upstreams = {s.name: s.upstream for s in topology.services}
    assert upstreams == {"gateway": "prefill_router", "grammar_compiler": "gateway", "prefill_router": "",
                         "prefill_worker": "prefill_router", "decode_router": "", "decode_worker": "decode_router",
                         "kv_writer": "", "swa_registry": "", "vision_balancer": "gateway",
                         "vision_worker": "vision_balancer"}
    for spec, _, config in topology.instances():
        cls = resolve(spec.kind)   # every kind is in the catalog
        if spec.kind in ("prefill_worker", "decode_worker"):
            settings = parse_settings(WorkerSettings, config.settings, spec.kind)
            assert settings.engine["model_dir"] == ".epd/models/deepseek-v41-tiny"
        elif spec.kind == "prefill_router":
            parse_settings(PrefillRouterSettings, config.settings, spec.kind)
        elif spec.kind != "gateway":   # the gateway loads its tokenizer when built; the others just parse
            cls(config)
    kv_root = topology.spec("kv_writer").options["settings"]["root"]
    assert topology.spec("prefill_worker").options["settings"]["kv_store_dir"] == kv_root


def test_each_worker_pool_scales_on_its_own_and_every_replica_keeps_its_router_and_peers():
    data = tomllib.loads((resources.files("ops.topologies") / "default.toml").read_text())
    pools = {"prefill_worker": 3, "decode_worker": 2, "grammar_compiler": 2, "vision_worker": 3}
    for raw in data["service"]:
        raw["replicas"] = pools.get(raw["name"], 1)
    topology = parse_topology(data, port_base=32000)
    instances = topology.instances()
    assert len(instances) == 10 - 4 + 10
    assert len({config.bind for _, _, config in instances}) == len(instances)   # every replica its own port
    address = {spec.name: config.bind for spec, replica, config in instances if replica == 0}
    for spec, _, config in instances:
        if spec.name == "grammar_compiler":   # registers with the gateway, which spreads constraints over them
            assert config.upstream == address["gateway"] and config.advertise == config.bind
        elif spec.name == "vision_worker":   # registers with its group's leader, which spreads images over them
            assert config.upstream == address["vision_balancer"] and config.advertise == config.bind
        elif spec.name in pools:   # registers with its router; reaches the one KV writer and SWA registry
            assert config.upstream == address[spec.upstream] and config.advertise == config.bind
            assert config.settings["kv_writer"] == address["kv_writer"]
            assert config.settings["swa_registry"] == address["swa_registry"]
    assert sum(spec.name == "prefill_worker" for spec, _, _ in instances) == 3


def test_worker_settings_refuse_unknown_keys_and_bad_values():
    with pytest.raises(ValueError, match="prefill_worker: unknown setting 'kv_writter'"):
        parse_settings(WorkerSettings, {"model_dir": "m", "kv_writter": "tcp://x:1"}, "prefill_worker")
    with pytest.raises(ValueError, match="handoff_timeout_s"):
        parse_settings(WorkerSettings, {"model_dir": "m", "handoff_timeout_s": 0}, "decode_worker")
    with pytest.raises(ValueError, match="capacity"):
        parse_settings(WorkerSettings, {"model_dir": "m", "capacity": -1}, "decode_worker")
    with pytest.raises(ValueError, match="'capacity' must be a finite int"):
        parse_settings(WorkerSettings, {"model_dir": "m", "capacity": "4"}, "decode_worker")


def test_worker_settings_know_every_engine_config_field():
    import dataclasses

    from engine.engine_core import EngineConfig
    assert set(ENGINE_KEYS) == {f.name for f in dataclasses.fields(EngineConfig)}
