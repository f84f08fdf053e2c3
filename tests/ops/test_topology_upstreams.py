"""A service registers with every replica of its upstream: the topology hands it their addresses
(ServiceConfig.upstream_replicas), and they reach its process through the environment."""
from __future__ import annotations

import pytest

from ops.topology import load_topology, parse_topology
from services.runtime.config import ServiceConfig


def test_every_aide_gets_every_gateway_replica():
    topology = load_topology("default", port_base=6600)
    topology.spec("gateway").replicas = 2
    configs = {c.instance: c for _, _, c in topology.instances()}
    gateways = [configs["gateway-0"].bind, configs["gateway-1"].bind]
    for aide in ("grammar_compiler-0", "vision_balancer-0"):
        config = configs[aide]
        assert [config.upstream, *config.upstream_replicas] == gateways, aide
    # a worker's upstream (its router) has one replica: nothing else to register with
    assert configs["prefill_worker-0"].upstream_replicas == ()


def test_upstream_replicas_reach_the_process_through_its_environment():
    config = ServiceConfig(kind="echo", instance="a", bind="tcp://127.0.0.1:7000", upstream="tcp://127.0.0.1:7001",
                           upstream_replicas=("tcp://127.0.0.1:7002", "tcp://127.0.0.1:7003"))
    assert ServiceConfig.from_env(config.to_env()).upstream_replicas == config.upstream_replicas
    with pytest.raises(ValueError, match="EPD_UPSTREAM_REPLICAS"):
        ServiceConfig.from_env({**config.to_env(), "EPD_UPSTREAM_REPLICAS": '"tcp://x:1"'})


def test_a_topology_cannot_set_the_replica_addresses_itself():
    with pytest.raises(ValueError, match="unknown keys"):
        parse_topology({"service": [{"name": "a", "kind": "echo", "upstream_replicas": ["tcp://x:1"]}]})


def test_an_upstream_that_is_no_http_front_is_registered_with_at_its_first_replica_only():
    topology = parse_topology({"service": [{"name": "router", "kind": "echo", "replicas": 2},
                                           {"name": "worker", "kind": "echo", "upstream": "router"}]})
    configs = {c.instance: c for _, _, c in topology.instances()}
    assert configs["worker-0"].upstream == configs["router-0"].bind
    assert configs["worker-0"].upstream_replicas == ()
