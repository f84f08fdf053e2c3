"""ServiceConfig: everything one service process needs to start, from code, a topology or EPD_* env."""
from __future__ import annotations

import dataclasses
import json
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Mapping

ENV_PREFIX = "EPD_"


@dataclass(slots=True)
class ServiceConfig:
    kind: str                         # a name in services.catalog, or "package.module:Class"
    instance: str = ""                # unique name; default <kind>-<hostname>-<pid>
    bind: str = "tcp://127.0.0.1:0"   # where the inbox (ROUTER) listens
    advertise: str = ""               # address peers use; "{hostname}" is replaced; default = bind
    upstream: str = ""                # address of the service that feeds us (we register there)
    upstream_replicas: tuple[str, ...] = ()   # its other replicas: we register and heartbeat there too
    metrics_bind: str = ""            # "host:port" for HTTP /metrics and /health; "" = off
    queue_size: int = 1024            # inbound messages waiting for a handler
    concurrency: int = 64             # handlers running at once
    hwm: int = 1000                   # ZeroMQ send/receive high-water marks (messages)
    grace_s: float = 10.0             # drain period on SIGTERM
    heartbeat_s: float = 1.0
    dead_after: int = 3               # missed heartbeats before a peer is dead
    ready_timeout_s: float = 30.0
    call_timeout_s: float = 30.0      # default for request/reply calls to peers
    log_level: str = "info"
    keys_dir: str = ""                # CURVE keys (`epd keys`): encrypted, authenticated sockets; "" = plaintext
    settings: dict[str, Any] = field(default_factory=dict)   # service-specific options

    def __post_init__(self) -> None:
        if not self.kind:
            raise ValueError("ServiceConfig.kind is required")
        host = socket.gethostname()
        if not self.instance:
            self.instance = f"{self.kind.rsplit(':', 1)[-1]}-{host}-{os.getpid()}"
        self.advertise = (self.advertise or self.bind).replace("{hostname}", host)
        for name in ("queue_size", "concurrency", "hwm", "dead_after"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServiceConfig.{name} must be >= 1")
        if self.heartbeat_s <= 0 or self.grace_s < 0:
            raise ValueError("heartbeat_s must be > 0 and grace_s >= 0")
        if self.advertise.endswith(":0"):
            raise ValueError("advertise a fixed port (bind to port 0 only in tests that set advertise)")

    @property
    def dead_after_s(self) -> float:
        return self.heartbeat_s * self.dead_after

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "ServiceConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown service config keys: {sorted(unknown)}")
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        """EPD_* variables from which `from_env` rebuilds this config in a child process."""
        env = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            structured = f.name in ("settings", "upstream_replicas")
            env[ENV_PREFIX + f.name.upper()] = json.dumps(value) if structured else str(value)
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ, **overrides: Any) -> "ServiceConfig":
        """Fields from EPD_<FIELD> variables (EPD_SETTINGS is JSON), then explicit overrides."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(ENV_PREFIX + f.name.upper())
            if raw is None:
                continue
            values[f.name] = _parse(f, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        if "kind" not in values:
            raise ValueError("no service kind: set EPD_KIND or pass --kind")
        return cls.from_mapping(values)


def _parse(f: dataclasses.Field, raw: str) -> Any:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        if kind.startswith("dict"):
            value = json.loads(raw)
            if not isinstance(value, dict):
                raise ValueError("expected a JSON object")
            return value
        if kind.startswith("tuple"):
            value = json.loads(raw)
            if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
                raise ValueError("expected a JSON list of strings")
            return tuple(value)
    except ValueError as exc:
        raise ValueError(f"{ENV_PREFIX}{f.name.upper()}={raw!r}: {exc}") from None
    return raw
