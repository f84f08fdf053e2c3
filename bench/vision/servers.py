"""The processes of `epd bench vision`'s real part: one vision balancer and N vision workers, each
`epd serve` configured through EPD_* variables (`python -m bench.vision.servers PARENT_PID`:
exactly `services.runtime.main`, plus death with the bench: PR_SET_PDEATHSIG)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from messages.control import ServiceState
from ops.control_client import query_status
from ops.ports import free_port_base
from services.runtime.config import ServiceConfig
from services.runtime.parent_death import die_with_parent

ROOT = Path(__file__).resolve().parents[2]


class VisionPoolProcesses:
    """A leader and its workers as child processes; `stop()` (or leaving the `with`) ends them all."""

    def __init__(self, logdir: Path, policy: str, workers: int, worker_settings: dict, seed: int = 0,
                 worker_kind: str = "vision_worker", devices: list[str] | None = None):
        self.logdir = logdir
        base = free_port_base(workers + 1)
        timing = {"heartbeat_s": 0.5, "dead_after": 4}
        self.leader = ServiceConfig(kind="vision_balancer", instance=f"bench-lead-{policy}",
                                    bind=f"tcp://127.0.0.1:{base}", settings={"policy": policy, "seed": seed},
                                    **timing)
        self.workers = [ServiceConfig(kind=worker_kind, instance=f"bench-{policy}-card{i}",
                                      bind=f"tcp://127.0.0.1:{base + 1 + i}", upstream=self.leader.advertise,
                                      settings={**worker_settings, **({"device": devices[i]} if devices else {})},
                                      **timing)
                        for i in range(workers)]
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "VisionPoolProcesses":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def address(self) -> str:
        return self.leader.advertise

    def start(self, timeout_s: float = 300.0) -> None:
        for config in (self.leader, *self.workers):
            self._spawn(config)
        deadline = time.monotonic() + timeout_s
        while True:
            status = query_status(self.address, 0.5)
            alive = [p for p in (status.peers if status else []) if p.alive and p.state == ServiceState.RUNNING]
            if len(alive) == len(self.workers):
                return
            for proc, config in zip(self.procs, (self.leader, *self.workers)):
                if proc.poll() is not None:
                    raise RuntimeError(f"{config.instance} exited {proc.returncode}:\n{self.log_tail(config)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the vision pool did not start within {timeout_s} s "
                                   f"({len(alive)} of {len(self.workers)} workers registered)")
            time.sleep(0.1)

    def _spawn(self, config: ServiceConfig) -> None:
        env = {**os.environ, **config.to_env(), "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        with open(self.logdir / f"{config.instance}.log", "ab") as log:
            self.procs.append(subprocess.Popen([sys.executable, "-m", "bench.vision.servers", str(os.getpid())],
                                               env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL))

    def log_tail(self, config: ServiceConfig, size: int = 3000) -> str:
        path = self.logdir / f"{config.instance}.log"
        return path.read_bytes()[-size:].decode(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()


def serve(parent_pid: int) -> int:
    die_with_parent(parent_pid)
    from services.runtime.main import main
    return main([])


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1])))
