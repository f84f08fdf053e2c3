"""A gateway's /ready waits for the aides the topology runs for it: the topology writes their kinds into the
gateway's `aides` setting (a value the topology file sets itself is kept)."""
from __future__ import annotations

from ops.topology import load_topology, parse_topology


def _gateway_settings(topology) -> dict:
    return next(c for spec, _, c in topology.instances() if spec.kind == "gateway").settings


def test_the_gateway_waits_for_the_aides_that_register_with_it():
    for name in ("default", "unified"):
        assert _gateway_settings(load_topology(name))["aides"] == ["grammar_compiler", "vision_balancer"], name


def test_a_topology_without_aides_declares_none_and_a_written_value_is_kept():
    bare = {"service": [{"name": "gw", "kind": "gateway", "upstream": "w"}, {"name": "w", "kind": "unified_worker"}]}
    assert "aides" not in _gateway_settings(parse_topology(bare))
    grammar = {"name": "g", "kind": "grammar_compiler", "upstream": "gw"}
    written = {"service": [{**bare["service"][0], "settings": {"aides": []}}, bare["service"][1], grammar]}
    assert _gateway_settings(parse_topology(written))["aides"] == []
    assert _gateway_settings(parse_topology({"service": [*bare["service"], grammar]}))["aides"] == ["grammar_compiler"]
