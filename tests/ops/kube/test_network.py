"""The NetworkPolicies: default deny, then exactly the service graph's edges on the ZeroMQ ports,
Prometheus on the metrics ports, anyone on the gateway's HTTP port.

EXPECTED_EDGES is the default stack's graph as read from the code (who opens a link to whom), kept
here by hand so that a rule dropped from ops/kube/edges.py, or a policy that stops allowing one of
its edges, fails this test."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from ops.kube import command as kube
from ops.kube.edges import service_edges
from ops.kube.network import DEFAULT_DENY, PROMETHEUS
from ops.topology import load_topology, parse_topology

ROOT = Path(__file__).resolve().parents[3]
POLICIES = ROOT / "deploy" / "k8s" / "base" / "network-policies.yaml"
COMPONENT = "app.kubernetes.io/component"

EXPECTED_EDGES = {   # (opens the link, is reached): why, in short
    ("gateway", "prefill_router"),             # upstream: GenerateRequest, Register, Heartbeat
    ("grammar_compiler", "gateway"),           # upstream: registers as an aide
    ("gateway", "grammar_compiler"),           # GrammarCompile (gateway/http_app.py)
    ("vision_balancer", "gateway"),            # upstream: registers as a vision group leader
    ("prefill_worker", "prefill_router"),      # upstream
    ("prefill_router", "prefill_worker"),      # PrefillWork, AbortRequest
    ("prefill_router", "decode_router"),       # settings.decode_router: DecodeTableQuery
    ("decode_worker", "decode_router"),        # upstream
    ("prefill_worker", "kv_writer"),           # settings.kv_writer
    ("decode_worker", "kv_writer"),            # settings.kv_writer: KvWritePages
    ("prefill_worker", "swa_registry"),        # settings.swa_registry: SwaFetch, SwaRegister
    ("decode_worker", "swa_registry"),         # settings.swa_registry: SwaRegister
    ("swa_registry", "prefill_worker"),        # SwaFetch forwarded to a holder
    ("swa_registry", "decode_worker"),         # SwaFetch forwarded to a holder
    ("prefill_worker", "prefill_worker"),      # SwaState from a holder to the fetching prefill worker
    ("decode_worker", "prefill_worker"),       # SwaState from a holder to the fetching prefill worker
    ("decode_worker", "gateway"),              # GenerateChunk to the return address, StatusQuery
    ("prefill_worker", "gateway"),             # the last GenerateChunk when the first token ends it
    ("gateway", "decode_worker"),              # AbortRequest, StatusQuery to the streaming worker
    ("gateway", "prefill_worker"),             # ... which a chunk may name
    ("prefill_worker", "decode_worker"),       # StateHandoff
    ("prefill_worker", "grammar_compiler"),    # GrammarCompile to the named compiler
    ("prefill_worker", "vision_balancer"),     # VisionEncode, VisionCancel
    ("vision_balancer", "prefill_worker"),     # VisionFailed to the requester
    ("vision_worker", "vision_balancer"),      # upstream: Register, Heartbeat, VisionDone
    ("vision_balancer", "vision_worker"),      # VisionEncode, VisionCancel
    ("vision_worker", "prefill_worker"),       # VisionEncoded and the embeddings
}


def policies() -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in yaml.safe_load_all(POLICIES.read_text()) if doc}


def allowed_edges(docs: dict[str, dict], zmq_port: dict[str, int]) -> set[tuple[str, str]]:
    """(client, server) pairs, by Kubernetes name, that the policies let reach a server's ZeroMQ port."""
    edges = set()
    for doc in docs.values():
        server = doc["spec"]["podSelector"]["matchLabels"].get(COMPONENT)
        for rule in doc["spec"].get("ingress", []):
            if {"protocol": "TCP", "port": zmq_port.get(server)} not in rule.get("ports", []):
                continue
            for peer in rule["from"]:
                assert set(peer) == {"podSelector"}, f"{server}: a ZeroMQ port open beyond the stack's pods"
                edges.add((peer["podSelector"]["matchLabels"][COMPONENT], server))
    return edges


def zmq_ports(topology) -> dict[str, int]:
    return {spec.name.replace("_", "-"): int(config.bind.rpartition(":")[2])
            for spec, replica, config in topology.instances() if replica == 0}


def dashed(edges) -> set[tuple[str, str]]:
    return {(a.replace("_", "-"), b.replace("_", "-")) for a, b in edges}


def test_the_policies_allow_exactly_the_edges_read_from_the_code():
    topology = load_topology("default")
    assert {(e.client, e.server) for e in service_edges(topology)} == EXPECTED_EDGES
    assert allowed_edges(policies(), zmq_ports(topology)) == dashed(EXPECTED_EDGES)


def test_every_edge_says_why_and_cites_code_that_exists():
    for edge in service_edges(load_topology("default")):
        cited = re.findall(r"services/[\w/]+\.py", edge.why)
        assert cited, edge
        for path in cited:
            assert (ROOT / path).is_file(), f"{edge.client} -> {edge.server} cites {path}, which is gone"
    text = POLICIES.read_text()
    assert "#   decode-worker -> gateway: GenerateChunk" in text
    assert "#   prefill-router -> decode-router: settings.decode_router: DecodeTableQuery" in text


def test_default_deny_covers_every_pod_and_only_gateway_http_is_open_to_all():
    docs = policies()
    deny = docs.pop(DEFAULT_DENY)
    assert deny["spec"] == {"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "epd"}},
                            "policyTypes": ["Ingress"]}
    topology = load_topology("default")
    assert set(docs) == {f"{s.name.replace('_', '-')}-ingress" for s in topology.services}
    for name, doc in docs.items():
        rules = doc["spec"]["ingress"]
        open_to_all = [rule for rule in rules if "from" not in rule]
        if name == "gateway-ingress":
            assert open_to_all == [{"ports": [{"protocol": "TCP", "port": 8000}]}]
        else:
            assert open_to_all == []
        metrics = [rule for rule in rules if rule.get("from") == [PROMETHEUS]]
        assert len(metrics) == 1 and metrics[0]["ports"][0]["port"] >= 5700, name   # port_base + metrics_offset


def test_edges_follow_the_topology_upstreams_peers_and_kinds():
    # Two prefill pools on one registry: each fetches window states from every holder, the registry
    # forwards to both, and a pool with no upstream is reached only through the message-borne rules.
    topology = parse_topology({"service": [
        {"name": "reg", "kind": "swa_registry"},
        {"name": "router", "kind": "prefill_router"},
        {"name": "pa", "kind": "prefill_worker", "upstream": "router", "settings": {"swa_registry": "@reg"}},
        {"name": "pb", "kind": "prefill_worker", "settings": {"swa_registry": "@reg"}},
        {"name": "grammar", "kind": "grammar_compiler", "upstream": "router"},
    ]})
    edges = {(e.client, e.server) for e in service_edges(topology)}
    assert edges == {
        ("pa", "router"), ("router", "pa"), ("grammar", "router"),
        ("pa", "reg"), ("pb", "reg"), ("reg", "pa"), ("reg", "pb"),
        ("pa", "pa"), ("pa", "pb"), ("pb", "pa"), ("pb", "pb"),
        ("pa", "grammar"), ("pb", "grammar"),
    }
    docs = {doc["metadata"]["name"]: doc for doc in yaml.safe_load_all(kube.base_files(topology)["network-policies.yaml"])
            if doc}
    assert allowed_edges(docs, zmq_ports(topology)) == edges
    assert docs["router-ingress"]["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"][COMPONENT] == "grammar"
