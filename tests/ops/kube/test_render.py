"""The overlays as `kubectl kustomize` renders them: each a complete stack in namespace epd whose
every object validates against the Kubernetes schemas (kubernetes-validate's bundled copies, read
with the network shut), GPUs on the workers only in `gpu`, probes and the CURVE keys everywhere."""
from __future__ import annotations

import functools
import json
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from ops.kube.overlays import GPU_KINDS, GPU_RESOURCE, MODEL_CLAIM
from ops.kube.workloads import KEYS_DIR, KEYS_SECRET, KVSTORE_CLAIM
from ops.topology import load_topology

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate (the test extra) is not installed")

ROOT = Path(__file__).resolve().parents[3]
OVERLAYS = ROOT / "deploy" / "k8s" / "overlays"
KUBECTL = shutil.which("kubectl")
SCHEMA_VERSIONS = ("1.29.0", kubernetes_validate.utils.latest_version())   # the oldest we support, the newest known
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
TOPOLOGY = load_topology("default")
KIND_OF = {spec.name.replace("_", "-"): spec.kind for spec in TOPOLOGY.services}

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed: it renders the overlays "
                                                        "(`kubectl kustomize`)")


@functools.cache
def render(overlay: str) -> list[dict]:
    out = subprocess.run([KUBECTL, "kustomize", str(OVERLAYS / overlay)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(params=["cpu-tiny", "gpu"])
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(request.param)


def of_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def settings_of(deployment: dict) -> dict:
    env = {e["name"]: e.get("value") for e in container(deployment)["env"]}
    return json.loads(env["EPD_SETTINGS"].replace("$$", "$"))


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection fails the test: the schemas must come from the package."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args[1:] or kwargs}")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def test_each_overlay_renders_a_complete_stack_in_its_namespace(rendered):
    overlay, docs = rendered
    names = set(KIND_OF)
    for kind in ("Deployment", "Service", "PodDisruptionBudget"):
        assert set(of_kind(docs, kind)) == names, kind
    assert set(of_kind(docs, "NetworkPolicy")) == {"epd-default-deny-ingress"} | {f"{n}-ingress" for n in names}
    claims = set(of_kind(docs, "PersistentVolumeClaim"))
    assert claims == ({KVSTORE_CLAIM, MODEL_CLAIM} if overlay == "gpu" else {KVSTORE_CLAIM})
    assert {doc["metadata"]["namespace"] for doc in docs} == {"epd"}


def test_every_rendered_object_validates_against_the_kubernetes_schemas(rendered, no_network):
    _overlay, docs = rendered
    for doc in docs:
        for version in SCHEMA_VERSIONS:   # strict: an unknown field is an error, not ignored
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_schema_check_rejects_a_broken_object(rendered, no_network):
    _overlay, docs = rendered
    broken = json.loads(json.dumps(next(iter(of_kind(docs, "Deployment").values()))))
    container(broken)["livenessProbe"]["periodSecond"] = 10   # a misspelt field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, SCHEMA_VERSIONS[-1], strict=True)


def test_names_are_dns_1123_labels(rendered):
    _overlay, docs = rendered
    for doc in docs:
        assert DNS_LABEL.match(doc["metadata"]["name"]), doc["metadata"]["name"]
    assert "prefill-worker" in of_kind(docs, "Deployment") and "prefill_worker" not in of_kind(docs, "Deployment")


def test_every_container_has_probes_and_the_curve_keys(rendered):
    _overlay, docs = rendered
    for name, deployment in of_kind(docs, "Deployment").items():
        c, pod = container(deployment), deployment["spec"]["template"]["spec"]
        for probe in ("startupProbe", "livenessProbe") + (() if name == "gateway" else ("readinessProbe",)):
            assert c[probe]["exec"]["command"][:3] == ["epd", "health", "--address"], (name, probe)
        if name == "gateway":   # it takes traffic while every pool behind it has a live worker
            assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
        assert {"name": "EPD_KEYS_DIR", "value": KEYS_DIR} in c["env"], name
        keys = next(m for m in c["volumeMounts"] if m["mountPath"] == KEYS_DIR)
        assert keys["readOnly"] is True
        assert {"name": keys["name"], "secret": {"secretName": KEYS_SECRET, "defaultMode": 0o440}} in pod["volumes"]


def test_gpu_limits_only_on_the_gpu_workers_of_the_gpu_overlay(rendered):
    overlay, docs = rendered
    for name, deployment in of_kind(docs, "Deployment").items():
        c, pod = container(deployment), deployment["spec"]["template"]["spec"]
        worker = KIND_OF[name] in GPU_KINDS
        gpus = c["resources"]["limits"].get(GPU_RESOURCE)
        assert "memory" in c["resources"]["limits"] and "cpu" in c["resources"]["requests"], name
        if overlay == "gpu" and worker:
            assert gpus == 1, name
            assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
            assert {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
            assert settings_of(deployment)["device"] == "cuda"
        else:
            assert gpus is None, name
            assert "nodeSelector" not in pod and "tolerations" not in pod, name
    workers = [n for n in of_kind(docs, "Deployment") if KIND_OF[n] in GPU_KINDS]
    assert sorted(workers) == ["decode-worker", "prefill-worker", "vision-worker"]


def test_dtype_agrees_between_the_workers_and_the_gateway_configures_none(rendered):
    overlay, docs = rendered
    dtype = "bfloat16" if overlay == "gpu" else "float32"
    deployments = of_kind(docs, "Deployment")
    for name in ("prefill-worker", "decode-worker", "vision-worker"):
        assert settings_of(deployments[name])["dtype"] == dtype, name
    assert "dtype" not in settings_of(deployments["gateway"])   # it learns the identity from the workers


def test_gpu_overlay_mounts_the_model_claim_over_every_model_directory(rendered):
    overlay, docs = rendered
    for name, deployment in of_kind(docs, "Deployment").items():
        model_dir = settings_of(deployment).get("model_dir") if any(
            e["name"] == "EPD_SETTINGS" for e in container(deployment)["env"]) else None
        mounts = {m["mountPath"]: m for m in container(deployment)["volumeMounts"] if m["name"] == "model"}
        if overlay == "gpu" and model_dir:
            assert mounts == {f"/var/lib/epd/{model_dir}": {"name": "model", "mountPath": f"/var/lib/epd/{model_dir}",
                                                            "readOnly": True}}, name
        else:
            assert mounts == {}, name


def test_cpu_tiny_runs_one_replica_per_pool_on_a_one_node_claim():
    docs = render("cpu-tiny")
    assert {d["spec"]["replicas"] for d in of_kind(docs, "Deployment").values()} == {1}
    assert of_kind(docs, "PersistentVolumeClaim")[KVSTORE_CLAIM]["spec"]["accessModes"] == ["ReadWriteOnce"]
