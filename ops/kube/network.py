"""NetworkPolicies: no ingress to the stack's pods but the service graph's edges (ops/kube/edges.py),
Prometheus on the metrics ports, and anyone on the gateway's HTTP port.

One policy denies all ingress to every pod of the stack (app.kubernetes.io/part-of=epd); then one
policy per service allows, on its ZeroMQ port, the services that open links to it, and on its
metrics port the Prometheus pods (PROMETHEUS: pods labelled app.kubernetes.io/name=prometheus in the
namespace `monitoring`; change both here if yours differ). Policies add up, so a pod is reachable
exactly on what some policy selecting it allows. Egress is not restricted.
Each policy is returned with a comment listing its edges and why they exist.
"""
from __future__ import annotations

from typing import Any

from ops.kube.edges import Edge
from ops.kube.stack import KubeStack
from ops.kube.workloads import PART_OF, labels, selector

DEFAULT_DENY = "epd-default-deny-ingress"
PROMETHEUS = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
}


def default_deny() -> tuple[dict[str, Any], str]:
    policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": DEFAULT_DENY, "labels": {"app.kubernetes.io/part-of": PART_OF}},
        "spec": {"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": PART_OF}}, "policyTypes": ["Ingress"]},
    }
    return policy, "Every pod of the stack: no ingress but what the policies below allow."


def ingress_policy(stack: KubeStack, server: str, edges: list[Edge]) -> tuple[dict[str, Any], str]:
    """The policy of service `server`: ingress from the clients of `edges` (those ending at it)."""
    name, ports = stack.names[server], stack.ports[server]
    clients = sorted({edge.client for edge in edges if edge.server == server}, key=stack.names.__getitem__)
    rules: list[dict[str, Any]] = []
    if clients:
        rules.append({"from": [{"podSelector": {"matchLabels": selector(stack.names[c])}} for c in clients],
                      "ports": [{"protocol": "TCP", "port": ports.zmq}]})
    if ports.metrics is not None:
        rules.append({"from": [PROMETHEUS], "ports": [{"protocol": "TCP", "port": ports.metrics}]})
    if ports.http is not None:   # the API: no `from`, so any source, in the cluster or beyond
        rules.append({"ports": [{"protocol": "TCP", "port": ports.http}]})
    policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": f"{name}-ingress", "labels": labels(name)},
        "spec": {"podSelector": {"matchLabels": selector(name)}, "policyTypes": ["Ingress"], "ingress": rules},
    }
    return policy, _comment(stack, server, edges)


def _comment(stack: KubeStack, server: str, edges: list[Edge]) -> str:
    name, ports = stack.names[server], stack.ports[server]
    lines = [f"{name}: ingress on its ZeroMQ port {ports.zmq} from the services that open links to it:"]
    incoming = [edge for edge in edges if edge.server == server]
    lines += [f"  {stack.names[edge.client]} -> {name}: {edge.why}" for edge in incoming] or ["  (none)"]
    if ports.metrics is not None:
        lines.append(f"Metrics port {ports.metrics}: from Prometheus (namespace monitoring, "
                     f"app.kubernetes.io/name=prometheus).")
    if ports.http is not None:
        lines.append(f"HTTP port {ports.http}: the API, from anywhere.")
    return "\n".join(lines)
