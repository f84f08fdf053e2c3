"""Topology files: parsing, validation, address assignment."""
from __future__ import annotations

import pytest

from ops.topology import load_topology, parse_topology


def test_embedded_default_topology_loads_with_distinct_addresses():
    topo = load_topology("default", port_base=6500)
    instances = topo.instances()
    assert instances, "the default topology must hold at least one service"
    binds = [c.bind for _, _, c in instances]
    metrics = [c.metrics_bind for _, _, c in instances]
    assert len(set(binds)) == len(binds) and len(set(metrics)) == len(metrics)
    assert binds[0] == "tcp://127.0.0.1:6500"


def test_replicas_and_upstream_resolve_to_addresses():
    topo = parse_topology({
        "stack": {"port_base": 7000, "grace_s": 4.0},
        "service": [{"name": "hub", "kind": "echo"},
                    {"name": "worker", "kind": "echo", "replicas": 2, "upstream": "hub", "queue_size": 8}]})
    configs = {c.instance: c for _, _, c in topo.instances()}
    assert set(configs) == {"hub-0", "worker-0", "worker-1"}
    assert configs["worker-1"].bind == "tcp://127.0.0.1:7002"
    assert configs["worker-0"].upstream == configs["hub-0"].bind
    assert configs["worker-0"].queue_size == 8 and configs["worker-0"].grace_s == 4.0


@pytest.mark.parametrize("data, message", [
    ({}, "at least one"),
    ({"service": [{"kind": "echo"}]}, "needs 'name'"),
    ({"service": [{"name": "a", "kind": "echo"}, {"name": "a", "kind": "echo"}]}, "unique"),
    ({"service": [{"name": "a", "kind": "echo", "upstream": "nowhere"}]}, "not in the topology"),
    ({"service": [{"name": "a", "kind": "echo", "colour": 1}]}, "unknown keys"),
    ({"service": [{"name": "a", "kind": "echo", "replicas": 0}]}, "replicas"),
    ({"stack": {"ports": 1}, "service": [{"name": "a", "kind": "echo"}]}, "unknown keys"),
])
def test_bad_topologies_are_refused_with_a_reason(data, message):
    with pytest.raises(ValueError, match=message):
        parse_topology(data)


def test_unknown_topology_name_is_a_clear_error():
    with pytest.raises(ValueError, match="no topology"):
        load_topology("no-such-topology")


# ---- named peers: settings = "@service" ----------------------------------------------------
def peered(port_base=None, host=None, store_replicas=1):
    return parse_topology({
        "stack": {"port_base": 7000},
        "service": [
            {"name": "front", "kind": "echo", "upstream": "pool",
             "settings": {"store": "@store", "fixed": "tcp://10.0.0.9:1", "label": "plain", "count": 3}},
            {"name": "store", "kind": "echo", "replicas": store_replicas},
            {"name": "pool", "kind": "echo", "replicas": 2, "upstream": "store", "settings": {"store": "@store"}}],
    }, port_base=port_base, host=host)


def configs(topology):
    return {c.instance: c for _, _, c in topology.instances()}


def test_a_named_peer_resolves_to_its_first_replica_and_other_values_pass_through():
    topo = peered()
    assert topo.spec("front").peers == {"store": "store"}
    got = configs(topo)
    assert got["front-0"].settings == {"store": "tcp://127.0.0.1:7001", "fixed": "tcp://10.0.0.9:1",
                                       "label": "plain", "count": 3}
    assert got["front-0"].settings["store"] == got["store-0"].bind == got["pool-1"].upstream
    assert got["pool-0"].settings["store"] == got["pool-1"].settings["store"] == "tcp://127.0.0.1:7001"
    assert topo.spec("front").options["settings"]["store"] == "@store"   # the spec keeps the name


def test_port_base_host_and_inserted_replicas_move_named_peers():
    moved = configs(peered(port_base=31000, host="10.1.2.3"))
    assert moved["front-0"].settings["store"] == moved["store-0"].bind == "tcp://10.1.2.3:31001"
    widened = configs(peered(store_replicas=3))     # the pool's slots shift past the store's replicas
    assert widened["pool-0"].bind == "tcp://127.0.0.1:7004"
    assert widened["front-0"].settings["store"] == widened["store-0"].bind == "tcp://127.0.0.1:7001"
    assert widened["front-0"].upstream == widened["pool-0"].bind


def test_an_unknown_peer_name_is_refused_naming_the_service_and_the_setting():
    data = {"service": [{"name": "router", "kind": "echo", "settings": {"kv_writer": "@kv_writr"}},
                        {"name": "kv_writer", "kind": "echo"}]}
    with pytest.raises(ValueError, match=r'service router: settings\.kv_writer = "@kv_writr" names no service'):
        parse_topology(data)
    with pytest.raises(ValueError, match="settings must be a table"):
        parse_topology({"service": [{"name": "a", "kind": "echo", "settings": "@a"}]})


def test_the_embedded_topologies_are_the_epd_form_and_the_unified_form():
    default = load_topology("default")
    assert [s.kind for s in default.services] == ["gateway", "grammar_compiler", "prefill_router", "prefill_worker",
                                                  "decode_router", "decode_worker", "kv_writer", "swa_registry",
                                                  "vision_balancer", "vision_worker"]
    assert load_topology("epd").services == default.services    # the E/P/D form's former name
    assert [s.kind for s in load_topology("unified").services] == ["unified_worker", "gateway", "grammar_compiler",
                                                                   "vision_balancer", "vision_worker"]
    for name in ("default", "unified"):
        for spec, _, config in load_topology(name).instances():
            if "model_dir" in config.settings:   # the CPU defaults on the tiny model of `make model`
                assert config.settings["model_dir"] == ".epd/models/deepseek-v41-tiny", spec.name
                if spec.kind not in ("gateway", "grammar_compiler", "vision_balancer"):   # no engine dtype there
                    assert config.settings["dtype"] == "float32", spec.name
                elif spec.kind == "gateway":   # it learns the model identity from the workers
                    assert "dtype" not in config.settings
