"""The overlays over the base: `cpu-tiny` and `gpu`, each a complete stack in namespace `epd`.

An overlay is a kustomization over the base plus one strategic-merge patch per Deployment (the
container is merged by name, env by name, mounts by path, volumes by name), written from a Profile:
    cpu-tiny  the image's baked tiny model in float32 (the topology's settings), small requests,
              one replica per pool; the KV store claim ReadWriteOnce (what a one-node dev cluster's
              default storage class offers; pods on one node share it)
    gpu       bfloat16 on CUDA for the GPU kinds (the gateway learns the model identity from them),
              one `nvidia.com/gpu` each, GPU nodes, larger
              requests, and the model from the claim `epd-model` mounted read-only over the model
              directory of every service that names one
A topology's `gpus` (local GPU pinning) plays no part here: the device plugin gives each pod its GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ops.kube.stack import KubeStack
from ops.kube.workloads import CONTAINER, KVSTORE_CLAIM, PROBE_PERIOD_S, environment, metadata
from ops.topology import ServiceSpec

NAMESPACE = "epd"
GPU_KINDS = ("prefill_worker", "decode_worker", "unified_worker", "vision_worker")
GPU_RESOURCE = "nvidia.com/gpu"
MODEL_CLAIM = "epd-model"


def _resources(cpu: str, memory: str, memory_limit: str, gpus: int = 0) -> dict[str, Any]:
    """Requests for scheduling, a memory limit; no CPU limit (throttling a worker stalls its batch)."""
    limits: dict[str, Any] = {"memory": memory_limit}
    if gpus:
        limits[GPU_RESOURCE] = gpus
    return {"requests": {"cpu": cpu, "memory": memory}, "limits": limits}


@dataclass(frozen=True)
class Profile:
    name: str
    summary: str
    resources: dict[str, dict[str, Any]]           # kind -> resources; "*" for the other kinds
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)   # kind -> settings it overrides
    pool_replicas: int | None = None                # every pool at this many replicas; None = the topology's
    gpu_pod: dict[str, Any] = field(default_factory=dict)   # pod spec fields for the GPU kinds
    gpu_startup_s: int | None = None                # startup allowance of the GPU kinds (weights load)
    model_claim: bool = False                       # mount MODEL_CLAIM over every model directory
    kvstore: dict[str, Any] = field(default_factory=dict)   # claim spec fields


GPU_SETTINGS = {"dtype": "bfloat16", "device": "cuda"}

PROFILES = (
    Profile(
        name="cpu-tiny",
        summary="the image's tiny model, float32 on CPU, small requests, one replica per pool",
        resources={"*": _resources("50m", "128Mi", "512Mi"),
                   "gateway": _resources("100m", "512Mi", "2Gi"),
                   "grammar_compiler": _resources("100m", "512Mi", "1Gi"),
                   **{kind: _resources("250m", "1Gi", "4Gi") for kind in GPU_KINDS}},
        pool_replicas=1,
        kvstore={"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
    ),
    Profile(
        name="gpu",
        summary="bfloat16 on one NVIDIA GPU per worker, the model from the claim epd-model",
        resources={"*": _resources("500m", "512Mi", "2Gi"),
                   "gateway": _resources("2", "4Gi", "8Gi"),
                   "grammar_compiler": _resources("4", "4Gi", "8Gi"),
                   "kv_writer": _resources("2", "4Gi", "8Gi"),
                   **{kind: _resources("8", "64Gi", "128Gi", gpus=1) for kind in GPU_KINDS}},
        settings={"grammar_compiler": {"processes": 4},   # compile processes: the topology's is the CPU default
                  **{kind: GPU_SETTINGS for kind in GPU_KINDS}},
        gpu_pod={"nodeSelector": {"nvidia.com/gpu.present": "true"},   # NVIDIA GPU feature discovery's label
                 "tolerations": [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]},
        gpu_startup_s=1200,
        model_claim=True,
    ),
)


def kustomization(stack: KubeStack, profile: Profile, base: str) -> dict[str, Any]:
    resources = [base] + (["model-claim.yaml"] if profile.model_claim else [])
    patches = [{"path": f"patches/{stack.names[spec.name]}.yaml"} for spec in stack.services]
    if profile.kvstore and _uses_store(stack):
        patches.append({"path": "patches/kvstore-claim.yaml"})
    return {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "namespace": NAMESPACE, "resources": resources, "patches": patches}


def deployment_patch(stack: KubeStack, profile: Profile, spec: ServiceSpec) -> dict[str, Any]:
    gpu = spec.kind in GPU_KINDS
    container: dict[str, Any] = {"name": CONTAINER,
                                 "resources": profile.resources.get(spec.kind, profile.resources["*"])}
    overrides = {key: value for key, value in profile.settings.get(spec.kind, {}).items()
                 if key in spec.options.get("settings", {}) or gpu}   # a GPU kind takes `device` anew
    if overrides:
        settings = stack.settings(spec, overrides)
        container["env"] = [entry for entry in environment(stack, spec, settings) if entry["name"] == "EPD_SETTINGS"]
    if gpu and profile.gpu_startup_s:
        container["startupProbe"] = {"failureThreshold": profile.gpu_startup_s // PROBE_PERIOD_S["startup"]}
    pod: dict[str, Any] = {"containers": [container]}
    model_dir = stack.model_dir(spec)
    if profile.model_claim and model_dir:
        container["volumeMounts"] = [{"name": "model", "mountPath": model_dir, "readOnly": True}]
        pod["volumes"] = [{"name": "model", "persistentVolumeClaim": {"claimName": MODEL_CLAIM, "readOnly": True}}]
    if gpu:
        pod.update(profile.gpu_pod)
    body: dict[str, Any] = {"template": {"spec": pod}}
    if profile.pool_replicas is not None and not stack.is_singleton(spec.name):
        body = {"replicas": profile.pool_replicas, **body}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": stack.names[spec.name]}, "spec": body}


def kvstore_patch(profile: Profile) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": KVSTORE_CLAIM},
            "spec": profile.kvstore}


def model_claim() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": metadata(MODEL_CLAIM),
        "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "2Ti"}}},
    }


def _uses_store(stack: KubeStack) -> bool:
    return any(stack.store_mount(spec) is not None for spec in stack.services)
