"""ops/topologies/epd.toml: the fixed peer addresses in its settings name the slots the topology
actually gives those services, and the stack's wiring is the E/P/D one."""
from __future__ import annotations

import tomllib

from ops.topology import load_topology, parse_topology
from services.catalog import resolve
from services.workers.common import WorkerSettings
from tests.workers.conftest import epd_topology_at

PEER_KEYS = {"kv_writer": "kv_writer", "swa_registry": "swa_registry", "decode_router": "decode_router"}


def addresses(topology) -> dict[str, str]:
    return {spec.name: config.advertise for spec, _, config in topology.instances()}


def check(topology) -> None:
    where = addresses(topology)
    for spec in topology.services:
        settings = spec.options.get("settings", {})
        for key, target in PEER_KEYS.items():
            if key in settings:
                assert settings[key] == where[target], f"{spec.name}.{key}"
    upstreams = {s.name: s.upstream for s in topology.services}
    assert upstreams["gateway"] == "prefill_router"
    assert upstreams["prefill_worker"] == "prefill_router" and upstreams["decode_worker"] == "decode_router"
    router = topology.spec("prefill_router").options["settings"]
    assert set(router) >= set(PEER_KEYS)


def test_the_embedded_epd_topology_wires_fixed_addresses_to_the_right_slots():
    topology = load_topology("epd")
    check(topology)
    for spec in topology.services:
        resolve(spec.kind)   # every kind is in the catalog
        if spec.kind in ("prefill_worker", "decode_worker"):
            settings = WorkerSettings.from_mapping(spec.options["settings"])
            assert settings.engine["model_dir"] == ".epd/models/deepseek-v4-tiny"
    kv_root = topology.spec("kv_writer").options["settings"]["root"]
    assert topology.spec("prefill_worker").options["settings"]["kv_store_dir"] == kv_root


def test_the_test_copy_moves_the_fixed_addresses_with_the_port_base():
    check(parse_topology(tomllib.loads(epd_topology_at(31000)), port_base=31000))


def test_worker_settings_refuse_unknown_keys_and_bad_values():
    import pytest
    with pytest.raises(ValueError, match="unknown worker settings"):
        WorkerSettings.from_mapping({"model_dir": "m", "kv_writter": "tcp://x:1"})
    with pytest.raises(ValueError, match="handoff_timeout_s"):
        WorkerSettings.from_mapping({"model_dir": "m", "handoff_timeout_s": 0})
    with pytest.raises(ValueError, match="capacity"):
        WorkerSettings.from_mapping({"model_dir": "m", "capacity": -1})
