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
