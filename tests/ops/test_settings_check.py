"""`epd up` checks every service's settings, with the services' own parsing, before it starts one."""
from __future__ import annotations

import pytest

from ops.cli import main
from ops.settings_check import settings_errors
from ops.topology import load_topology
from services.catalog import KINDS, SETTINGS, resolve
from services.runtime.config import ServiceConfig

GOOD = """
[stack]
port_base = 7700
[model]
dir = "m"
[[service]]
name = "router"
kind = "decode_router"
[[service]]
name = "worker"
kind = "decode_worker"
upstream = "router"
[service.settings]
{extra}
"""


@pytest.mark.parametrize("name", ["default", "unified", "gpu2"])
def test_the_embedded_topologies_pass(name):
    assert settings_errors(load_topology(name)) == []


def test_an_unknown_key_is_named_with_its_service_and_file(tmp_path):
    path = tmp_path / "typo.toml"
    path.write_text(GOOD.format(extra="kv_writter = \"tcp://x:1\""))
    [error] = settings_errors(load_topology(str(path)))
    assert error.startswith(f"{path}: service worker (decode_worker): unknown setting 'kv_writter'")


@pytest.mark.parametrize("key", ["capacity", "num_pages"])   # the worker's own, and one it passes to its engine
def test_a_value_of_the_wrong_type_is_named(tmp_path, key):
    path = tmp_path / "type.toml"
    path.write_text(GOOD.format(extra=f"{key} = \"4\""))
    [error] = settings_errors(load_topology(str(path)))
    assert f"{path}: service worker (decode_worker)" in error and f"'{key}' must be a finite int" in error


def test_a_service_with_replicas_is_reported_once(tmp_path):
    path = tmp_path / "replicas.toml"
    path.write_text(GOOD.format(extra="bogus = 1").replace('upstream = "router"', 'upstream = "router"\nreplicas = 3'))
    assert len(settings_errors(load_topology(str(path)))) == 1


def test_epd_up_refuses_bad_settings_before_it_starts_anything(tmp_path, monkeypatch, capsys):
    path = tmp_path / "typo.toml"
    path.write_text(GOOD.format(extra="kv_writter = \"tcp://x:1\""))
    monkeypatch.setenv("EPD_RUN_ROOT", str(tmp_path / "runs"))
    assert main(["up", "--detach", "--topology", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"epd up: {path}: service worker (decode_worker): unknown setting 'kv_writter'" in err
    assert not (tmp_path / "runs").exists()   # no run directory, no supervisor, no service


@pytest.mark.parametrize("kind", sorted(SETTINGS))
def test_the_checked_class_is_the_one_the_service_parses(kind):
    """The catalog's settings class refuses what the service itself refuses, with the same message."""
    assert set(SETTINGS) == set(KINDS) - {"echo"}
    config = ServiceConfig(kind=kind, instance="x", bind="tcp://127.0.0.1:1", settings={"no_such_key": 1})
    with pytest.raises(ValueError, match=f"^{kind}: unknown setting 'no_such_key'") as by_service:
        resolve(kind)(config)
    topology_error = settings_errors(_one_service(kind, {"no_such_key": 1}))
    assert [e.split("): ", 1)[1] for e in topology_error] == [str(by_service.value).split(": ", 1)[1]]


def _one_service(kind: str, settings: dict):
    from ops.topology import parse_topology
    return parse_topology({"service": [{"name": "s", "kind": kind, "settings": settings}]}, source="t.toml")


@pytest.mark.parametrize("command", ["compose", "kube"])
def test_epd_compose_and_kube_refuse_bad_settings_before_they_write_anything(tmp_path, capsys, command):
    path = tmp_path / "typo.toml"
    path.write_text(GOOD.format(extra="kv_writter = \"tcp://x:1\""))
    out = tmp_path / "out"
    argv = [command, "--topology", str(path), "--out", str(out / "docker-compose.yml" if command == "compose" else out)]
    assert main([*argv, *(["--overlays", str(tmp_path / "overlays")] if command == "kube" else [])]) == 2
    captured = capsys.readouterr()
    assert f"epd {command}: {path}: service worker (decode_worker): unknown setting 'kv_writter'" in captured.err
    assert captured.out == "" and not out.exists() and not (tmp_path / "overlays").exists()


@pytest.mark.parametrize("command", ["compose", "kube"])
def test_epd_compose_and_kube_still_write_a_good_topology(tmp_path, command):
    path = tmp_path / "good.toml"
    path.write_text(GOOD.format(extra="capacity = 4"))
    out = tmp_path / "out"
    out.mkdir()
    assert main([command, "--topology", str(path), "--out",
                 str(out / "docker-compose.yml" if command == "compose" else out)]) == 0
    assert any(out.iterdir())
