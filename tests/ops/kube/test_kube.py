"""`epd kube`: the committed deploy/k8s tree is what the generator writes for the default topology,
the generated objects carry the topology's configuration (EPD_* env, ports, probes, keys, the KV
store), singletons and pools are told apart, and names are DNS-1123 labels. Rendering the overlays
with kubectl and validating against the Kubernetes schemas is in test_render.py; the
NetworkPolicies' edges are in test_network.py."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from ops.kube import command as kube
from ops.kube.stack import KubeStack, dns_name
from ops.kube.workloads import KEYS_DIR, KEYS_SECRET, KVSTORE_CLAIM
from ops.topology import load_topology, parse_topology
from services.runtime.config import ServiceConfig

ROOT = Path(__file__).resolve().parents[3]
BASE = ROOT / "deploy" / "k8s" / "base"
OVERLAYS = ROOT / "deploy" / "k8s" / "overlays"
POD_IP = "10.1.2.3"

# A scaled pool with a "$" in its settings, a writer and a reader pool of an absolute store path,
# a named peer and an upstream that are singletons.
RICH = {
    "stack": {"port_base": 6000, "metrics_offset": 50, "grace_s": 20.0, "ready_timeout_s": 42.0},
    "service": [
        {"name": "reg", "kind": "swa_registry"},
        {"name": "store", "kind": "kv_writer", "settings": {"root": "/mnt/kv"}},
        {"name": "front_door", "kind": "gateway", "upstream": "reg",
         "settings": {"http_bind": "127.0.0.1:8080", "note": "a$b"}},
        {"name": "readers", "kind": "prefill_worker", "replicas": 3, "upstream": "reg", "queue_size": 16,
         "settings": {"kv_store_dir": "/mnt/kv", "kv_writer": "@store", "swa_registry": "@reg"}},
    ],
}


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="epd")
    kube.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def committed(directory: Path) -> dict[str, str]:
    return {path.relative_to(directory).as_posix(): path.read_text() for path in sorted(directory.rglob("*.yaml"))}


def objects(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def by_kind(files: dict[str, str], kind: str) -> dict[str, dict]:
    return {obj["metadata"]["name"]: obj for text in files.values() for obj in objects(text) if obj["kind"] == kind}


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def env_of(deployment: dict) -> dict[str, str]:
    """The environment the process sees: $(POD_IP) expanded and "$$" unescaped, as the kubelet does."""
    env = {entry["name"]: entry.get("value") for entry in container(deployment)["env"]}
    return {key: value.replace("$(POD_IP)", POD_IP).replace("$$", "$") for key, value in env.items()
            if value is not None}


def test_committed_tree_is_what_epd_kube_generates_for_the_default_topology():
    topology = load_topology("default")
    assert committed(BASE) == kube.base_files(topology, ref="default"), (
        "deploy/k8s/base is stale: run `epd kube --topology default --out deploy/k8s/base --overlays deploy/k8s/overlays`")
    assert committed(OVERLAYS) == kube.overlay_files(topology, ref="default"), "deploy/k8s/overlays is stale: (same)"


def test_cli_writes_the_tree_and_removes_only_stale_generated_files(tmp_path, capsys):
    base, overlays = tmp_path / "k8s" / "base", tmp_path / "k8s" / "overlays"
    base.mkdir(parents=True)
    (base / "old-service.yaml").write_text(kube.GENERATED_MARK + " --topology default` ...\nkind: Service\n")
    (base / "mine.yaml").write_text("# a file of the user's\n")
    assert cli(["kube", "--out", str(base), "--overlays", str(overlays)]) == 0
    assert not (base / "old-service.yaml").exists()
    assert (base / "mine.yaml").read_text() == "# a file of the user's\n"
    (base / "mine.yaml").unlink()
    assert committed(base) == committed(BASE)
    assert committed(overlays) == committed(OVERLAYS)   # the overlays name ../../base
    assert "wrote" in capsys.readouterr().err


def test_cli_names_the_base_relative_to_each_overlay(tmp_path):
    assert cli(["kube", "--out", str(tmp_path / "b"), "--overlays", str(tmp_path / "deep" / "o")]) == 0
    overlay = yaml.safe_load((tmp_path / "deep" / "o" / "gpu" / "kustomization.yaml").read_text())
    assert overlay["resources"][0] == "../../../b"


def test_cli_rejects_an_unknown_topology_and_a_replicated_singleton(tmp_path, capsys):
    assert cli(["kube", "--topology", "no-such-stack", "--out", str(tmp_path)]) == 2
    assert "no-such-stack" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text('[[service]]\nname = "router"\nkind = "decode_router"\nreplicas = 2\n'
                   '[[service]]\nname = "w"\nkind = "decode_worker"\nupstream = "router"\n')
    assert cli(["kube", "--topology", str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "service router: replicas = 2" in err and "w reach it by its name" in err
    assert not (tmp_path / "out").exists()


def test_names_are_dns_1123_labels_and_underscores_become_dashes():
    assert dns_name("prefill_worker") == "prefill-worker"
    assert dns_name("Decode_Router") == "decode-router"
    for bad in ("_front", "front_", "préfill", "x" * 64):
        with pytest.raises(ValueError, match="DNS-1123"):
            dns_name(bad)
    names = set(by_kind(committed(BASE), "Deployment"))
    assert names == {s.name.replace("_", "-") for s in load_topology("default").services}


def test_two_services_with_the_same_kubernetes_name_are_refused():
    topology = parse_topology({"service": [{"name": "a_b", "kind": "echo"}, {"name": "a-b", "kind": "echo"}]})
    with pytest.raises(ValueError, match="same Kubernetes name"):
        KubeStack(topology)


def test_environment_rebuilds_the_local_config_with_cluster_addresses():
    topology = parse_topology(RICH, source="test:rich")
    files = kube.base_files(topology, ref="rich")
    deployments = by_kind(files, "Deployment")
    local = {spec.name: config for spec, replica, config in topology.instances() if replica == 0}
    for spec in topology.services:
        deployment = deployments[dns_name(spec.name)]
        env_entries = container(deployment)["env"]
        assert env_entries[0] == {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
        env = env_of(deployment)
        config = ServiceConfig.from_env(env)
        port = int(local[spec.name].bind.rpartition(":")[2])
        assert config.kind == spec.kind
        assert config.bind == f"tcp://0.0.0.0:{port}"
        assert config.advertise == f"tcp://{POD_IP}:{port}"
        assert config.metrics_bind == f"0.0.0.0:{local[spec.name].metrics_bind.rpartition(':')[2]}"
        assert env["EPD_KEYS_DIR"] == KEYS_DIR
        for field in ("queue_size", "grace_s", "ready_timeout_s", "hwm", "log_level"):
            assert getattr(config, field) == getattr(local[spec.name], field), (spec.name, field)
        assert container(deployment)["args"] == ["serve", spec.kind]
    readers = ServiceConfig.from_env(env_of(deployments["readers"]))
    assert readers.upstream == "tcp://reg:6000"
    assert readers.settings == {"kv_store_dir": "/mnt/kv", "kv_writer": "tcp://store:6001", "swa_registry": "tcp://reg:6000"}
    front = ServiceConfig.from_env(env_of(deployments["front-door"]))
    assert front.settings == {"http_bind": "0.0.0.0:8080", "note": "a$b"}   # "$$" in the manifest
    assert '"note": "a$$b"' in files["front-door.yaml"]


def test_singletons_are_single_clusterip_recreated_and_pools_scale_headless():
    topology = parse_topology(RICH, source="test:rich")
    files = kube.base_files(topology)
    deployments, services, budgets = (by_kind(files, kind) for kind in ("Deployment", "Service", "PodDisruptionBudget"))
    for name in ("reg", "store"):   # reached by name: an upstream, a named peer
        assert deployments[name]["spec"]["replicas"] == 1
        assert deployments[name]["spec"]["strategy"] == {"type": "Recreate"}
        assert "clusterIP" not in services[name]["spec"]
        assert budgets[name]["spec"]["minAvailable"] == 1
    for name, replicas in (("readers", 3), ("front-door", 1)):   # reached by the addresses they advertise
        assert deployments[name]["spec"]["replicas"] == replicas
        assert deployments[name]["spec"]["strategy"]["type"] == "RollingUpdate"
        assert services[name]["spec"]["clusterIP"] == "None"
        assert budgets[name]["spec"]["maxUnavailable"] == 1
    default = by_kind(kube.base_files(load_topology("default")), "Deployment")
    singles = {name for name, d in default.items() if d["spec"]["strategy"]["type"] == "Recreate"}
    assert singles == {"gateway", "prefill-router", "decode-router", "kv-writer", "swa-registry", "vision-balancer"}


def test_every_container_probes_its_inbox_with_epd_health_and_mounts_the_keys():
    topology = parse_topology(RICH, source="test:rich")
    for deployment in by_kind(kube.base_files(topology), "Deployment").values():
        c, pod = container(deployment), deployment["spec"]["template"]["spec"]
        port = next(p["containerPort"] for p in c["ports"] if p["name"] == "zmq")
        serves_http = any(p["name"] == "http" for p in c["ports"])   # the gateway: readiness is its /ready
        for probe in ("startupProbe", "livenessProbe") + (() if serves_http else ("readinessProbe",)):
            assert c[probe]["exec"]["command"] == ["epd", "health", "--address", f"tcp://127.0.0.1:{port}"]
        if serves_http:
            assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
        assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 42.0   # ready_timeout_s
        assert {"name": "keys", "mountPath": KEYS_DIR, "readOnly": True} in c["volumeMounts"]
        assert {"name": "keys", "secret": {"secretName": KEYS_SECRET, "defaultMode": 0o440}} in pod["volumes"]
        assert pod["terminationGracePeriodSeconds"] == 25   # grace_s 20 + 5


def test_the_kv_store_claim_is_written_by_the_writer_and_read_by_the_readers():
    topology = parse_topology(RICH, source="test:rich")
    files = kube.base_files(topology)
    claim = by_kind(files, "PersistentVolumeClaim")[KVSTORE_CLAIM]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert "3FS" in files["kvstore-claim.yaml"] and "NFS" in files["kvstore-claim.yaml"]
    deployments = by_kind(files, "Deployment")
    for name, read_only in (("store", False), ("readers", True)):
        pod = deployments[name]["spec"]["template"]["spec"]
        assert {"name": "kvstore", "persistentVolumeClaim": {"claimName": KVSTORE_CLAIM}} in pod["volumes"]
        assert {"name": "kvstore", "mountPath": "/mnt/kv", "readOnly": read_only} in container(deployments[name])["volumeMounts"]
    for name in ("reg", "front-door"):
        assert all(v["name"] != "kvstore" for v in deployments[name]["spec"]["template"]["spec"]["volumes"])
    default = by_kind(kube.base_files(load_topology("default")), "Deployment")
    mounts = {name: m for name, d in default.items() for m in container(d)["volumeMounts"] if m["name"] == "kvstore"}
    assert set(mounts) == {"kv-writer", "prefill-router", "prefill-worker"}
    assert {m["mountPath"] for m in mounts.values()} == {"/var/lib/epd/.epd/kvstore"}


def test_only_the_gateway_listens_for_http_and_every_service_exposes_its_metrics():
    services = by_kind(committed(BASE), "Service")
    for name, svc in services.items():
        port_names = {p["name"] for p in svc["spec"]["ports"]}
        assert port_names == ({"zmq", "metrics", "http"} if name == "gateway" else {"zmq", "metrics"}), name
    gateway = by_kind(committed(BASE), "Deployment")["gateway"]
    assert ServiceConfig.from_env(env_of(gateway)).settings["http_bind"] == "0.0.0.0:8000"
