"""Topology files: which services a stack runs, how many of each, and how they find each other.

A TOML file with a [stack] table, a [model] table and one [[service]] table per service:
    name, kind, replicas, upstream (the name of the service it registers with), settings, and
    any ServiceConfig field (queue_size, concurrency, hwm, grace_s, heartbeat_s, ...).
Addresses are assigned here: instance i of the whole stack (in file order, replicas included) gets
tcp://host:(port_base + i). A service registers with its upstream's first replica, or, where the
upstream is an HTTP front (a gateway), with every replica (ServiceConfig's upstream and
upstream_replicas): each gateway replica then knows every grammar compiler and vision leader.

The model, named once. [model] says what every service serves:
    [model]
    dir = ".epd/models/deepseek-v41-tiny"   # config.json, tokenizer.json, weights
    dtype = "float32"                       # the engines' dtype (absent: the model's own)
    weights = "model"                       # "released": the workers keep the release's packed formats
The launcher hands each kind the keys it takes, as settings (MODEL_SETTINGS): the gateway and the
grammar compiler the directory; the engine workers all three; the vision worker dir and dtype. A
service's settings may not name them again (`model_dir`, `dtype`, `weights` there are an error that
says where they moved). The model identity every block hash carries is derived by the workers from
these three (`+released` included) and announced when they register; the gateway and the routers
learn it from there and never configure it (services/runtime/registration.py).

Embedded topologies (ops/topologies/, loaded by name): "default", the E/P/D form (gateway, prefill
router and workers, decode router and workers, KV writer, SWA registry), "unified", a gateway
in front of one unified worker, and "gpu2", the E/P/D form on a host with two GPUs (prefill on GPU 0,
decode on GPU 1, bfloat16); "epd" is the E/P/D form's former name (ALIASES).

Named peers. A service that talks to a peer other than its upstream takes the peer's address from
a setting. Write the peer's service name with an "@" instead of an address:
    [service.settings]
    kv_writer = "@kv_writer"            # the address of the service named kv_writer
Only top-level string values of `settings` that start with "@" are peer names; anything else,
literal "tcp://..." addresses included, passes through unchanged. A name resolves to the address of
the service's first replica (as `upstream` does): here `tcp://host:port` of the local stack, so
--port-base, --host and inserted replicas move it; `ops/compose/command.py` resolves it to
`tcp://<service name>:<port>` (Compose DNS). A name that is not a service of the topology is a
ValueError naming the service and the setting.

GPU pinning. A service whose processes run a model (the engine workers, the vision worker) may list
the GPUs its replicas run on:
    gpus = [0, 1]          # replica i runs on GPU gpus[i]
The launcher starts replica i with CUDA_VISIBLE_DEVICES=gpus[i] (and CUDA_DEVICE_ORDER=PCI_BUS_ID,
so the indices are the host's, as nvidia-smi numbers them; a CUDA_VISIBLE_DEVICES of the launcher's
own environment is replaced, not narrowed), and the service's `device` setting is "cuda" (set when
absent): inside the process the pinned GPU is cuda:0, so "cuda:1" there is an error. Rules: GPU
indices are ints >= 0, none twice in one list (no two replicas of a service share a GPU), and
`replicas` <= len(gpus) (more GPUs than replicas: the rest wait for a larger `replicas`). Different
services may name the same GPU (a vision worker beside the prefill worker it feeds): GPU memory is the
topology author's to budget. Only kinds that run a model on a device take `gpus` (GPU_KINDS; a
"module:Class" kind is trusted to).
"""
from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable

from services.gateway.readiness import AIDE_KINDS
from services.runtime.config import ServiceConfig

PEER_PREFIX = "@"
# Embedded topologies known by an older name: "epd" was the E/P/D form before it became "default".
ALIASES = {"epd": "default"}

# Kinds whose settings take a torch `device` (EngineConfig's, the vision worker's): only these take `gpus`.
GPU_KINDS = ("prefill_worker", "decode_worker", "unified_worker", "vision_worker")
PINNED_DEVICES = ("cuda", "cuda:0")      # what a pinned process may call its one visible GPU

# [model] key -> the settings key a service takes it as; kind -> the [model] keys its settings take
MODEL_KEYS = {"dir": "model_dir", "dtype": "dtype", "weights": "weights"}
_ENGINE = ("dir", "dtype", "weights")
MODEL_SETTINGS = {"gateway": ("dir",), "grammar_compiler": ("dir",), "prefill_worker": _ENGINE,
                  "decode_worker": _ENGINE, "unified_worker": _ENGINE, "vision_worker": ("dir", "dtype")}

_CONFIG_FIELDS = {f.name for f in dataclasses.fields(ServiceConfig)} - {"kind", "instance", "bind", "advertise",
                                                                           "upstream", "upstream_replicas",
                                                                           "metrics_bind"}


@dataclass(slots=True)
class ServiceSpec:
    name: str
    kind: str
    replicas: int = 1
    upstream: str = ""                       # name of another service in the topology
    options: dict[str, Any] = field(default_factory=dict)   # ServiceConfig fields, settings included
    gpus: tuple[int, ...] = ()               # replica i runs on GPU gpus[i] (the module docstring)

    def __post_init__(self) -> None:
        if not self.name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"service name {self.name!r}: use letters, digits, '_' and '-'")
        if self.replicas < 1:
            raise ValueError(f"service {self.name}: replicas must be >= 1")
        unknown = set(self.options) - _CONFIG_FIELDS
        if unknown:
            raise ValueError(f"service {self.name}: unknown keys {sorted(unknown)}")
        if not isinstance(self.options.get("settings", {}), dict):
            raise ValueError(f"service {self.name}: settings must be a table")
        if self.gpus != ():
            self._check_gpus()

    def _check_gpus(self) -> None:
        gpus = self.gpus
        if not isinstance(gpus, (list, tuple)) or not gpus or not all(type(g) is int and g >= 0 for g in gpus):
            raise ValueError(f"service {self.name}: gpus must be a list of GPU indices (ints >= 0), got {gpus!r}")
        self.gpus = tuple(gpus)
        if len(set(gpus)) != len(gpus):
            raise ValueError(f"service {self.name}: gpus {list(gpus)} names a GPU twice; "
                             "each replica of a service needs a GPU of its own")
        if self.replicas > len(gpus):
            raise ValueError(f"service {self.name}: replicas = {self.replicas} but gpus lists {len(gpus)} "
                             f"({list(gpus)}); each replica needs a GPU of its own: list more GPUs or "
                             "run fewer replicas")
        if ":" not in self.kind and self.kind not in GPU_KINDS:
            raise ValueError(f"service {self.name}: kind {self.kind} runs no model on a device, so it takes "
                             f"no gpus (kinds that do: {', '.join(GPU_KINDS)})")
        settings = self.options.get("settings", {})
        device = settings.get("device", "cuda")
        if device not in PINNED_DEVICES:
            raise ValueError(f"service {self.name}: device = {device!r} with gpus: each replica sees only its "
                             f"own GPU, as cuda:0; write device = \"cuda\" or leave it out")
        self.options["settings"] = {**settings, "device": device}

    def gpu(self, replica: int) -> int | None:
        """The GPU replica `replica` is pinned to; None when the service names no gpus."""
        return self.gpus[replica] if self.gpus else None

    @property
    def is_front(self) -> bool:
        """Whether it serves the HTTP API (a gateway): what registers with it registers with every replica."""
        return "http_bind" in self.options.get("settings", {})

    @property
    def peers(self) -> dict[str, str]:
        """Settings key -> the service name it holds as "@name"."""
        settings = self.options.get("settings", {})
        return {key: value[len(PEER_PREFIX):] for key, value in settings.items()
                if isinstance(value, str) and value.startswith(PEER_PREFIX)}

    def resolved_settings(self, address_of: Callable[[str], str]) -> dict[str, Any]:
        """The settings with every "@name" replaced by address_of(name)."""
        peers = self.peers
        return {key: address_of(peers[key]) if key in peers else value
                for key, value in self.options.get("settings", {}).items()}


@dataclass(slots=True)
class Topology:
    services: list[ServiceSpec]
    host: str = "127.0.0.1"
    port_base: int = 5600
    metrics_offset: int = 100
    grace_s: float = 10.0
    ready_timeout_s: float = 60.0
    source: str = ""
    model: dict[str, str] = field(default_factory=dict)   # the [model] table (already in each service's settings)

    def __post_init__(self) -> None:
        names = [s.name for s in self.services]
        if len(set(names)) != len(names):
            raise ValueError("service names must be unique")
        for spec in self.services:
            if spec.upstream and spec.upstream not in names:
                raise ValueError(f"service {spec.name}: upstream {spec.upstream!r} is not in the topology")
            for key, peer in spec.peers.items():
                if peer not in names:
                    raise ValueError(f"service {spec.name}: settings.{key} = \"{PEER_PREFIX}{peer}\" names no service "
                                     f"of the topology (services: {', '.join(names)})")
        for gateway in (s for s in self.services if s.kind == "gateway"):   # its /ready waits for its aides
            aides = sorted({s.kind for s in self.services if s.upstream == gateway.name and s.kind in AIDE_KINDS})
            if aides:
                gateway.options.setdefault("settings", {}).setdefault("aides", aides)

    def spec(self, name: str) -> ServiceSpec:
        for spec in self.services:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def instances(self) -> list[tuple[ServiceSpec, int, ServiceConfig]]:
        """(spec, replica index, config) for every process of the local stack, in start order."""
        slots = self._slots()
        out = []
        for spec in self.services:
            upstream = self.address(spec.upstream) if spec.upstream else ""   # its first replica
            # ... and, where that is an HTTP front, its others: an aide registers with every gateway replica
            fronted = spec.upstream and self.spec(spec.upstream).is_front
            others = tuple(self._address(slot) for slot in slots[spec.upstream][1:]) if fronted else ()
            options = {"grace_s": self.grace_s, "ready_timeout_s": self.ready_timeout_s, **spec.options}
            if "settings" in options:
                options["settings"] = spec.resolved_settings(self.address)
            for replica, slot in enumerate(slots[spec.name]):
                config = ServiceConfig(
                    kind=spec.kind, instance=f"{spec.name}-{replica}", bind=self._address(slot), upstream=upstream,
                    upstream_replicas=others,
                    metrics_bind=f"{self.host}:{self.port_base + self.metrics_offset + slot}", **options)
                out.append((spec, replica, config))
        return out

    def gpu_of(self, instance: str) -> int | None:
        """The GPU an instance ("<service>-<replica>", as instances() names them) is pinned to, if any."""
        name, _, replica = instance.rpartition("-")
        for spec in self.services:
            if spec.name == name and replica.isdigit() and int(replica) < spec.replicas:
                return spec.gpu(int(replica))
        return None

    def instance_env(self, instance: str) -> dict[str, str]:
        """Environment the topology sets for one instance's process: a pinned replica sees its GPU alone."""
        return gpu_env(self.gpu_of(instance))

    def address(self, name: str) -> str:
        """The local address of service `name`'s first replica: where its upstream and peers reach it."""
        return self._address(self._slots()[name][0])

    def _address(self, slot: int) -> str:
        return f"tcp://{self.host}:{self.port_base + slot}"

    def _slots(self) -> dict[str, list[int]]:
        """Service name -> its instances' slots (port offsets), in file order."""
        slots: dict[str, list[int]] = {}
        slot = 0
        for spec in self.services:
            slots[spec.name] = list(range(slot, slot + spec.replicas))
            slot += spec.replicas
        return slots


def gpu_env(gpu: int | None) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES for a process pinned to host GPU `gpu` (nvidia-smi's numbering); {} for None."""
    if gpu is None:
        return {}
    return {"CUDA_VISIBLE_DEVICES": str(gpu), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def load_topology(name_or_path: str | None = None, *, port_base: int | None = None,
                  host: str | None = None, http_port: int | None = None, model_dir: str | None = None) -> Topology:
    """A topology from a file path, or by name from the embedded ones ("default", ...).
    `model_dir`: the [model] table's dir is this one instead (the gateway serves it under its name)."""
    name_or_path = ALIASES.get(name_or_path or "default", name_or_path or "default")
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        text, source = path.read_text(), str(path)
    else:
        embedded = resources.files("ops.topologies") / f"{name_or_path}.toml"
        if not embedded.is_file():
            raise ValueError(f"no topology file or embedded topology named {name_or_path!r}")
        text, source = embedded.read_text(), f"embedded:{name_or_path}"
    data = tomllib.loads(text)
    if model_dir is not None:
        data["model"] = {**data.get("model", {}), "dir": model_dir}
    topology = parse_topology(data, source=source, port_base=port_base, host=host)
    if http_port is not None:   # move every HTTP front (the gateway's API) to this port
        for spec in topology.services:
            settings = spec.options.get("settings", {})
            if "http_bind" in settings:
                bind_host = settings["http_bind"].rpartition(":")[0] or topology.host
                spec.options["settings"] = {**settings, "http_bind": f"{bind_host}:{http_port}"}
    if model_dir is not None:   # the gateway serves it under the directory's name
        for spec in topology.services:
            settings = spec.options.get("settings", {})
            if "served_model" in settings:
                spec.options["settings"] = {**settings, "served_model": Path(model_dir).name}
    return topology


def parse_topology(data: dict, *, source: str = "", port_base: int | None = None,
                   host: str | None = None) -> Topology:
    stack = dict(data.get("stack", {}))
    unknown = set(stack) - {"host", "port_base", "metrics_offset", "grace_s", "ready_timeout_s"}
    if unknown:
        raise ValueError(f"[stack]: unknown keys {sorted(unknown)}")
    model = parse_model(data.get("model", {}))
    services = []
    for raw in data.get("service", []):
        raw = dict(raw)
        try:
            name, kind = raw.pop("name"), raw.pop("kind")
        except KeyError as exc:
            raise ValueError(f"[[service]] needs {exc.args[0]!r}") from None
        if kind in MODEL_SETTINGS:
            raw["settings"] = with_model(name, kind, raw.get("settings", {}), model)
        services.append(ServiceSpec(name=name, kind=kind, replicas=raw.pop("replicas", 1),
                                    upstream=raw.pop("upstream", ""), gpus=raw.pop("gpus", ()), options=raw))
    if not services:
        raise ValueError("a topology needs at least one [[service]]")
    if port_base is not None:
        stack["port_base"] = port_base
    if host is not None:
        stack["host"] = host
    return Topology(services=services, source=source, model=model, **stack)


def parse_model(table: dict) -> dict[str, str]:
    """The [model] table, checked: string values of known keys, `dir` among them."""
    if not isinstance(table, dict):
        raise ValueError("[model] must be a table")
    unknown = set(table) - set(MODEL_KEYS)
    if unknown:
        raise ValueError(f"[model]: unknown keys {sorted(unknown)} (known: {', '.join(MODEL_KEYS)})")
    for key, value in table.items():
        if not isinstance(value, str) or not value:
            raise ValueError(f"[model]: {key} must be a non-empty string, got {value!r}")
    if table and "dir" not in table:
        raise ValueError("[model] needs dir (the model directory)")
    return dict(table)


def with_model(name: str, kind: str, settings: dict, model: dict[str, str]) -> dict:
    """A service's settings plus the [model] keys its kind takes; naming one of them there is an error."""
    if not isinstance(settings, dict):
        return settings   # ServiceSpec says what is wrong
    for key, setting in MODEL_KEYS.items():
        if setting in settings:
            raise ValueError(f"service {name}: settings.{setting} moved to the topology's [model] table "
                             f"({key} = ...): the model is named once, for every service")
    return {**{MODEL_KEYS[key]: model[key] for key in MODEL_SETTINGS[kind] if key in model}, **settings}
