"""The echo servers of `epd bench wire`, as child processes (`python -m bench.wire.servers
PARENT_PID ...`): the runtime's own echo service, or a raw blocking pyzmq ROUTER echo, each with
CURVE when given a keys dir. Children starts them and stops them all when the bench ends; each
dies with the bench (PR_SET_PDEATHSIG)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from services.runtime.parent_death import die_with_parent

ROOT = Path(__file__).resolve().parents[2]
HWM = 1000   # the runtime's default high-water mark, on every socket of the bench


class Children:
    """Echo servers started by this bench; all stopped on exit."""

    def __init__(self, logdir: Path):
        self.logdir = logdir
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "Children":
        return self

    def __exit__(self, *exc) -> None:
        for proc in list(self.procs):
            self.stop(proc)

    def start(self, name: str, argv: list[str], timeout_s: float = 60.0) -> subprocess.Popen:
        log_path = self.logdir / f"{name}.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "bench.wire.servers", str(os.getpid()), *argv],
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT, env=env)
        self.procs.append(proc)
        deadline = time.monotonic() + timeout_s
        while b"service.ready" not in log_path.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                self.stop(proc)
                tail = log_path.read_bytes()[-2000:].decode(errors="replace")
                raise RuntimeError(f"echo server {name} did not start:\n{tail}")
            time.sleep(0.02)
        return proc

    def stop(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.remove(proc)


def serve(argv: list[str]) -> int:
    """`PARENT_PID raw ADDRESS copy|zerocopy [KEYS_DIR]` or `PARENT_PID runtime ADDRESS [KEYS_DIR]`."""
    parent, kind, address, *rest = argv
    die_with_parent(int(parent))
    if kind == "runtime":   # exactly `python -m services.runtime.main echo` (uvloop, the default config)
        from services.runtime.curve import KEYS_ENV
        from services.runtime.main import main
        os.environ[KEYS_ENV] = rest[0] if rest else ""   # the service's config reads it
        return main(["echo", "--instance", f"bench-echo-{os.getpid()}", "--bind", address])
    return raw_echo(address, copy=rest[0] == "copy", keys_dir=rest[1] if len(rest) > 1 else "")


def raw_echo(address: str, copy: bool, keys_dir: str = "") -> int:
    """ROUTER echo in a plain blocking loop: every message goes back as it came."""
    import zmq
    from services.runtime.curve import load_keys, serve_curve, start_authenticator
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    for opt, value in ((zmq.SNDHWM, HWM), (zmq.RCVHWM, HWM), (zmq.LINGER, 0), (zmq.ROUTER_MANDATORY, 1)):
        sock.setsockopt(opt, value)
    if keys_dir:   # as a service's inbox: CURVE server, ZAP admitting the client key (runs until killed)
        keys = load_keys(keys_dir)
        start_authenticator(ctx, keys)
        serve_curve(sock, keys)
    sock.bind(address)
    print("service.ready", flush=True)
    while True:
        sock.send_multipart(sock.recv_multipart(copy=copy), copy=copy)


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit("usage: python -m bench.wire.servers PARENT_PID "
                 "(raw ADDRESS copy|zerocopy | runtime ADDRESS) [KEYS_DIR]")
    sys.exit(serve(sys.argv[1:]))
