"""A topology seen from Kubernetes: DNS names, ports, who is reached by name, each service's settings.

Kubernetes names are DNS-1123 labels, so a topology service `prefill_worker` becomes `prefill-worker`
(its Deployment, Service, PodDisruptionBudget and NetworkPolicy). The ports are those of the
service's first replica in the local stack (`Topology.instances()`), as in the Compose file.

Singletons and pools. A service another one reaches by its Service name (an `upstream`, or a named
peer such as `kv_writer = "@kv_writer"`) runs one replica: Kubernetes would spread the connections
to that name over the replicas, and every caller must reach the same one (the routers' member
tables, the KV writer's one index, the SWA registry's one table, the gateway its aides register
with). Such a service gets a ClusterIP Service (its name survives pod restarts). Every other
service is a pool: its pods register with their upstream by their own address, so it scales by
replicas and gets a headless Service (pod DNS, no load balancing).
"""
from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from typing import Any

from ops.compose.command import CONTAINER_WORKDIR, PUBLISHED_HTTP, STORE_DIRS
from ops.topology import ServiceSpec, Topology
from services.runtime.config import ServiceConfig

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def dns_name(service_name: str) -> str:
    """The Kubernetes name of a topology service: lower case, '_' -> '-' (a DNS-1123 label)."""
    name = service_name.lower().replace("_", "-")
    if len(name) > 63 or not _DNS_LABEL.match(name):
        raise ValueError(f"service {service_name!r}: {name!r} is not a DNS-1123 label (a-z, 0-9, '-', "
                         f"at most 63 characters, starting and ending with a letter or digit)")
    return name


def container_path(path: str) -> str:
    """A settings path as the container sees it: relative paths start at the image's WORKDIR."""
    return posixpath.normpath(posixpath.join(CONTAINER_WORKDIR, path))


@dataclass(frozen=True, slots=True)
class Ports:
    zmq: int              # the inbox (EPD_BIND)
    metrics: int | None   # /metrics and /health (EPD_METRICS_BIND)
    http: int | None      # the HTTP API, for the kinds in PUBLISHED_HTTP


@dataclass(frozen=True, slots=True)
class StoreMount:
    path: str            # absolute, in the container
    read_only: bool


class KubeStack:
    """What the manifests need to know about a topology, computed once."""

    def __init__(self, topology: Topology):
        self.topology = topology
        self.config: dict[str, ServiceConfig] = {}   # service name -> its first replica's local config
        for spec, _replica, config in topology.instances():
            self.config.setdefault(spec.name, config)
        self.names = {spec.name: dns_name(spec.name) for spec in topology.services}
        if len(set(self.names.values())) != len(self.names):
            raise ValueError(f"two services get the same Kubernetes name: {sorted(self.names.values())}")
        self.ports = {spec.name: self._ports(spec) for spec in topology.services}
        self.callers_by_name = self._callers_by_name()
        for spec in topology.services:
            if spec.name in self.callers_by_name and spec.replicas > 1:
                raise ValueError(f"service {spec.name}: replicas = {spec.replicas}, but "
                                 f"{', '.join(self.callers_by_name[spec.name])} reach it by its name, which "
                                 f"Kubernetes spreads over replicas; give it one replica")

    @property
    def services(self) -> list[ServiceSpec]:
        return self.topology.services

    def is_singleton(self, name: str) -> bool:
        return name in self.callers_by_name

    def address(self, name: str) -> str:
        """Where other pods reach service `name` by its Service name."""
        return f"tcp://{self.names[name]}:{self.ports[name].zmq}"

    def settings(self, spec: ServiceSpec, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        """The service's settings in the cluster: named peers by Service name, the HTTP front on every
        interface, then `overrides` (an overlay's)."""
        settings = spec.resolved_settings(self.address)
        published = PUBLISHED_HTTP.get(spec.kind)
        if published and self.ports[spec.name].http is not None:
            settings[published[0]] = f"0.0.0.0:{self.ports[spec.name].http}"
        return {**settings, **(overrides or {})}

    def store_mount(self, spec: ServiceSpec) -> StoreMount | None:
        """The KV store directory this service names (the writer's root, a reader's kv_store_dir)."""
        if spec.kind not in STORE_DIRS:
            return None
        key, default, read_only = STORE_DIRS[spec.kind]
        directory = spec.options.get("settings", {}).get(key, default)
        return StoreMount(container_path(directory), read_only) if directory else None

    def model_dir(self, spec: ServiceSpec) -> str | None:
        directory = spec.options.get("settings", {}).get("model_dir")
        return container_path(directory) if directory else None

    def _ports(self, spec: ServiceSpec) -> Ports:
        config = self.config[spec.name]
        metrics = _port(config.metrics_bind) if config.metrics_bind else None
        published = PUBLISHED_HTTP.get(spec.kind)
        http = _port(spec.options.get("settings", {}).get(published[0], published[1])) if published else None
        return Ports(_port(config.bind), metrics, http)

    def _callers_by_name(self) -> dict[str, list[str]]:
        """Service name -> the services that reach it by name (upstream or named peer), in file order."""
        callers: dict[str, list[str]] = {}
        for spec in self.services:
            for target in dict.fromkeys((spec.upstream, *spec.peers.values())):
                if target and target != spec.name:
                    callers.setdefault(target, []).append(spec.name)
        return callers


def _port(address: str) -> int:
    return int(address.rpartition(":")[2])
