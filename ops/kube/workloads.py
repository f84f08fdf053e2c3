"""Per topology service: its Deployment, Service and PodDisruptionBudget; and the KV store's claim.

Each container runs the one image with `serve <kind>` and is configured only by EPD_* variables,
as in the Compose file:
    EPD_BIND       tcp://0.0.0.0:<port>
    EPD_ADVERTISE  tcp://$(POD_IP):<port>    the pod's own IP (downward API): how its router, and
                                             anyone it gives its address to, reach this one replica
    EPD_UPSTREAM   tcp://<upstream Service>:<port>
    EPD_SETTINGS   named peers as tcp://<peer Service>:<port>
    EPD_KEYS_DIR   the `epd-keys` Secret (ZeroMQ CURVE keys), mounted read-only
Kubernetes expands $(VAR) in values, so a literal "$" is written "$$".
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from ops.kube.stack import KubeStack
from ops.topology import ServiceSpec
from services.runtime.config import ENV_PREFIX, ServiceConfig

IMAGE = "epd:latest"
CONTAINER = "epd"
USER_ID = 10001                       # compose/Dockerfile's `epd` user
PART_OF = "epd"                       # app.kubernetes.io/part-of of every object: the NetworkPolicies select on it
COMPONENT = "app.kubernetes.io/component"
KEYS_SECRET = "epd-keys"              # made out of band: epd keys --out DIR && kubectl create secret generic ...
KEYS_DIR = "/run/secrets/epd-keys"
KVSTORE_CLAIM = "epd-kvstore"
KVSTORE_SIZE = "100Gi"
STOP_MARGIN_S = 5                     # the kubelet's wait after SIGTERM = the service's drain (grace_s) + this
PROBE_PERIOD_S = {"startup": 5, "readiness": 10, "liveness": 20}   # `epd health` costs ~0.5 s CPU a run
PROBE_TIMEOUT_S = 5
LIVENESS_FAILURES = 3


def labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "epd", "app.kubernetes.io/part-of": PART_OF, COMPONENT: name}


def selector(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/part-of": PART_OF, COMPONENT: name}


def metadata(name: str) -> dict[str, Any]:
    return {"name": name, "labels": labels(name)}


def deployment(stack: KubeStack, spec: ServiceSpec) -> dict[str, Any]:
    name, config, ports = stack.names[spec.name], stack.config[spec.name], stack.ports[spec.name]
    singleton = stack.is_singleton(spec.name)
    pod_annotations = {}
    if ports.metrics is not None:   # for annotation-driven Prometheus scraping
        pod_annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(ports.metrics),
                           "prometheus.io/path": "/metrics"}
    volumes = [{"name": "keys", "secret": {"secretName": KEYS_SECRET, "defaultMode": 0o440}}]
    mounts = [{"name": "keys", "mountPath": KEYS_DIR, "readOnly": True}]
    store = stack.store_mount(spec)
    if store is not None:
        volumes.append({"name": "kvstore", "persistentVolumeClaim": {"claimName": KVSTORE_CLAIM}})
        mounts.append({"name": "kvstore", "mountPath": store.path, "readOnly": store.read_only})
    container = {
        "name": CONTAINER,
        "image": IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "args": ["serve", spec.kind],   # the image's ENTRYPOINT is `epd`
        "env": environment(stack, spec),
        "ports": container_ports(stack, spec),
        **probes(ports.zmq, config.ready_timeout_s, serves_http=ports.http is not None),
        "volumeMounts": mounts,
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    template_metadata: dict[str, Any] = {"labels": labels(name)}
    if pod_annotations:
        template_metadata["annotations"] = pod_annotations
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(name),
        "spec": {
            "replicas": 1 if singleton else spec.replicas,
            "selector": {"matchLabels": selector(name)},
            # a singleton is never two at once (two KV writers on one index, two routers each with
            # half the workers); a pool replaces one pod at a time and needs no spare accelerator
            "strategy": {"type": "Recreate"} if singleton else
                        {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "template": {
                "metadata": template_metadata,
                "spec": {
                    "automountServiceAccountToken": False,   # no pod talks to the Kubernetes API
                    "enableServiceLinks": False,             # no <SERVICE>_PORT variables in the environment
                    "terminationGracePeriodSeconds": math.ceil(config.grace_s) + STOP_MARGIN_S,
                    "securityContext": {"runAsUser": USER_ID, "runAsGroup": USER_ID, "runAsNonRoot": True,
                                        "fsGroup": USER_ID, "fsGroupChangePolicy": "OnRootMismatch",
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }


def environment(stack: KubeStack, spec: ServiceSpec, settings: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The container's env list: POD_IP first (EPD_ADVERTISE refers to it), then EPD_* in
    ServiceConfig's field order; of the other fields, only those the topology sets (as `to_env`
    writes them). `settings`: the service's settings in the cluster (default: stack.settings)."""
    config, ports = stack.config[spec.name], stack.ports[spec.name]
    config = dataclasses.replace(config, settings=stack.settings(spec) if settings is None else settings)
    addresses = {
        "bind": f"tcp://0.0.0.0:{ports.zmq}",
        "advertise": f"tcp://$(POD_IP):{ports.zmq}",
        "upstream": stack.address(spec.upstream) if spec.upstream else "",
        "metrics_bind": f"0.0.0.0:{ports.metrics}" if ports.metrics is not None else "",
    }
    explicit = {"kind", "grace_s", "ready_timeout_s", *spec.options, *(["settings"] if settings is not None else [])}
    written = config.to_env()
    env: list[dict[str, Any]] = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    for f in dataclasses.fields(ServiceConfig):
        key = ENV_PREFIX + f.name.upper()
        if f.name in addresses:
            if addresses[f.name]:
                env.append({"name": key, "value": addresses[f.name]})
        elif f.name in explicit:
            env.append({"name": key, "value": written[key].replace("$", "$$")})
    env.append({"name": ENV_PREFIX + "KEYS_DIR", "value": KEYS_DIR})
    return env


def container_ports(stack: KubeStack, spec: ServiceSpec) -> list[dict[str, Any]]:
    ports = stack.ports[spec.name]
    out = [{"name": "zmq", "containerPort": ports.zmq, "protocol": "TCP"}]
    if ports.metrics is not None:
        out.append({"name": "metrics", "containerPort": ports.metrics, "protocol": "TCP"})
    if ports.http is not None:
        out.append({"name": "http", "containerPort": ports.http, "protocol": "TCP"})
    return out


def probes(port: int, ready_timeout_s: float, serves_http: bool = False) -> dict[str, Any]:
    """`epd health` inside the container: exit 0 only while the service is RUNNING (not starting,
    not draining). The startup probe allows the service's ready_timeout_s; then readiness takes a
    draining pod out of its Service and liveness restarts one that stopped answering. The gateway's
    readiness is its HTTP /ready: it takes traffic only while every pool behind it has a live worker."""
    command = {"exec": {"command": ["epd", "health", "--address", f"tcp://127.0.0.1:{port}"]}}
    ready = {"httpGet": {"path": "/ready", "port": "http"}} if serves_http else command
    start = PROBE_PERIOD_S["startup"]
    return {
        "startupProbe": {**command, "periodSeconds": start, "timeoutSeconds": PROBE_TIMEOUT_S,
                         "failureThreshold": max(1, math.ceil(ready_timeout_s / start))},
        "readinessProbe": {**ready, "periodSeconds": PROBE_PERIOD_S["readiness"],
                           "timeoutSeconds": PROBE_TIMEOUT_S, "failureThreshold": 1},
        "livenessProbe": {**command, "periodSeconds": PROBE_PERIOD_S["liveness"],
                          "timeoutSeconds": PROBE_TIMEOUT_S, "failureThreshold": LIVENESS_FAILURES},
    }


def service(stack: KubeStack, spec: ServiceSpec) -> dict[str, Any]:
    """ClusterIP for a singleton (reached by this name); headless for a pool (its pods are reached by
    the addresses they advertise; the Service gives them DNS names and scrape targets)."""
    name = stack.names[spec.name]
    ports = [{"name": p["name"], "port": p["containerPort"], "targetPort": p["name"], "protocol": "TCP"}
             for p in container_ports(stack, spec)]
    body: dict[str, Any] = {"selector": selector(name), "ports": ports}
    if not stack.is_singleton(spec.name):
        body = {"clusterIP": "None", **body}
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata(name), "spec": body}


def disruption_budget(stack: KubeStack, spec: ServiceSpec) -> dict[str, Any]:
    """A pool loses at most one pod at a time to a drain (each drains its requests on SIGTERM and the
    gateway resumes the rest). A singleton is never evicted voluntarily: every request needs it, so
    a node drain waits until an operator moves it (`kubectl delete pod`). A pod that is not ready
    may always be evicted, so a broken one never blocks a drain."""
    name = stack.names[spec.name]
    budget = {"minAvailable": 1} if stack.is_singleton(spec.name) else {"maxUnavailable": 1}
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(name),
        "spec": {**budget, "selector": {"matchLabels": selector(name)}, "unhealthyPodEvictionPolicy": "AlwaysAllow"},
    }


def kvstore_claim() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": metadata(KVSTORE_CLAIM),
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": KVSTORE_SIZE}}},
    }
