"""Test-only: drive `docker compose` (v2) or Debian's `docker-compose` (v1) for the Compose stack test."""
from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose" / "docker-compose.yml"
PROJECT = "epdcomposetest"
PROJECT_LABEL = f"label=com.docker.compose.project={PROJECT}"


def compose_command() -> list[str] | None:
    """`docker compose` when the v2 plugin answers, else `docker-compose`, else None."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"],
                                                 capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def docker_answers() -> str:
    """"" when a Docker engine answers, else why not."""
    if not shutil.which("docker"):
        return "no docker client"
    result = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True)
    return "" if result.returncode == 0 else f"no Docker engine: {result.stderr.strip()[:200]}"


class ComposeStackForTests:
    """One Compose project of the committed compose/docker-compose.yml."""

    def __init__(self, command: list[str]):
        self.base = [*command, "-p", PROJECT, "-f", str(COMPOSE_FILE)]

    def run(self, *args: str, timeout: float = 300, check: bool = True, stdin: str | None = None
            ) -> subprocess.CompletedProcess:
        result = subprocess.run([*self.base, *args], capture_output=True, text=True, timeout=timeout,
                                input=stdin, cwd=ROOT)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed ({result.returncode}): {result.stderr[-2000:]}")
        return result

    def containers(self, service: str | None = None) -> list[dict]:
        """{name, id, service, state, health} of this project's containers (all states)."""
        filters = ["--filter", PROJECT_LABEL]
        if service:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        ids = subprocess.run(["docker", "ps", "-aq", *filters], capture_output=True, text=True,
                             check=True).stdout.split()
        if not ids:
            return []
        inspected = json.loads(subprocess.run(["docker", "inspect", *ids], capture_output=True, text=True,
                                              check=True).stdout)
        return [{
            "name": item["Name"].lstrip("/"),
            "id": item["Id"][:12],
            "service": item["Config"]["Labels"].get("com.docker.compose.service", ""),
            "state": item["State"]["Status"],
            "health": (item["State"].get("Health") or {}).get("Status", ""),
        } for item in inspected]

    def wait_healthy(self, expected: dict[str, int], timeout_s: float = 420) -> None:
        """Until every expected service has that many running, healthy containers (and no others)."""
        deadline = time.monotonic() + timeout_s
        while True:
            containers = [c for c in self.containers() if c["state"] == "running"]
            counts = {name: sum(1 for c in containers if c["service"] == name and c["health"] == "healthy")
                      for name in expected}
            if counts == expected and len(containers) == sum(expected.values()):
                return
            if time.monotonic() > deadline:
                logs = self.run("logs", "--no-color", "--tail", "30", check=False).stdout[-6000:]
                raise AssertionError(f"not healthy after {timeout_s:.0f} s: {counts} of {expected}\n{logs}")
            time.sleep(2)   # polling Docker's health state, not waiting out a race

    def logs(self, *services: str) -> str:
        return self.run("logs", "--no-color", *services).stdout

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, networks and volumes of this project that still exist."""
        def listed(*argv: str) -> list[str]:
            return subprocess.run(["docker", *argv], capture_output=True, text=True, check=True).stdout.split()
        return {
            "containers": listed("ps", "-aq", "--filter", PROJECT_LABEL),
            "networks": listed("network", "ls", "-q", "--filter", PROJECT_LABEL),
            "volumes": listed("volume", "ls", "-q", "--filter", PROJECT_LABEL),
        }


def log_records(text: str) -> list[tuple[str, dict]]:
    """(log prefix, JSON record) of each `compose logs` line that carries one."""
    records = []
    for line in text.splitlines():
        prefix, bar, rest = line.partition("|")
        brace = rest.find("{")
        if not bar or brace < 0:
            continue
        try:
            records.append((prefix.strip(), json.loads(rest[brace:])))
        except json.JSONDecodeError:
            continue
    return records
