"""`epd up`, `epd down`, `epd status`, `epd health`: run and inspect a local stack."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

RUN_ROOT_ENV = "EPD_RUN_ROOT"


def run_root() -> Path:
    return Path(os.environ.get(RUN_ROOT_ENV, ".epd/runs"))


def current_run_dir(explicit: str | None = None) -> Path:
    if explicit:
        return Path(explicit)
    return run_root() / "current"


def read_state(run_dir: Path) -> dict:
    path = run_dir / "state.json"
    if not path.exists():
        raise FileNotFoundError(f"no stack state at {path}: is a stack running (`epd up`)?")
    return json.loads(path.read_text())


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:   # a zombie child of ours counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


# ---- up ----------------------------------------------------------------------------------
def cmd_up(args) -> int:
    from ops.launcher import Supervisor
    from ops.settings_check import refuse_bad_settings
    from ops.topology import load_topology
    try:
        topology = load_topology(args.topology, port_base=args.port_base, http_port=args.http_port,
                                 model_dir=args.model)
    except (ValueError, OSError) as exc:
        print(f"epd up: {exc}", file=sys.stderr)
        return 2
    if refuse_bad_settings(topology, "up"):   # before anything starts: a typo is an error, not a crash loop
        return 2
    keys_dir = _up_keys_dir(args)
    if keys_dir is None:
        return 2
    run_dir = Path(args.run_dir) if args.run_dir else run_root() / (time.strftime("%Y%m%d-%H%M%S-") + str(os.getpid()))
    if args.detach:
        return _up_detached(args, run_dir, keys_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    _point_current_at(run_dir)
    return Supervisor(topology, run_dir, keys_dir=keys_dir).run(on_ready=_print_ready)


def _up_keys_dir(args) -> str | None:
    """The stack's CURVE keys dir as an absolute path ("" = plaintext), from --keys or EPD_KEYS_DIR
    (so a stack and the tools of the same shell agree); None after saying why it is unusable."""
    from services.runtime.curve import KEYS_ENV, KeysError, load_keys
    keys = args.keys if args.keys is not None else os.environ.get(KEYS_ENV, "")
    if not keys:
        return ""
    try:
        return load_keys(Path(keys).resolve()).directory
    except KeysError as exc:
        print(f"epd up: {exc}", file=sys.stderr)
        return None


def _point_current_at(run_dir: Path) -> None:
    link = run_dir.parent / "current"
    tmp = run_dir.parent / f".current-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(run_dir.resolve())
    tmp.replace(link)


def _print_ready(supervisor) -> None:
    print(f"epd: stack ready ({len(supervisor.children)} services, topology {supervisor.topology.source})")
    for child in supervisor.children:
        print(f"  {child.config.instance:<24} {child.config.kind:<16} {child.config.advertise:<26} "
              f"http://{child.config.metrics_bind}/metrics")
    gateways = [c for c in supervisor.children if c.config.kind == "gateway"]
    if gateways:
        settings = gateways[0].config.settings
        api = f"http://{settings.get('http_bind', '127.0.0.1:8000')}"
        print(f"API: {api}/v1  (OpenAI Chat Completions, Responses; Anthropic Messages)")
        print(f"  curl {api}/v1/chat/completions -H 'Content-Type: application/json' -d "
              f"'{{\"model\": \"{settings.get('served_model', 'deepseek-v41-tiny')}\", "
              f"\"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}], \"max_tokens\": 16}}'")
    else:
        print("API: none yet (this topology has no gateway service)")
    if supervisor.keys_dir:
        print(f"links: CURVE, keys {supervisor.keys_dir} (tools: export EPD_KEYS_DIR={supervisor.keys_dir})")
    print(f"logs: {supervisor.run_dir}/logs   status: epd status   stop: Ctrl-C or epd down", flush=True)


def _up_detached(args, run_dir: Path, keys_dir: str) -> int:
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "ops.cli", "up", "--run-dir", str(run_dir), "--keys", keys_dir]
    if args.topology:
        argv += ["--topology", args.topology]
    if args.model:
        argv += ["--model", args.model]
    if args.port_base is not None:
        argv += ["--port-base", str(args.port_base)]
    if args.http_port is not None:
        argv += ["--http-port", str(args.http_port)]
    with open(run_dir / "supervisor.out", "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + args.wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            print(f"epd up: the stack failed to start; see {run_dir / 'supervisor.out'}", file=sys.stderr)
            print((run_dir / "supervisor.out").read_text()[-2000:], file=sys.stderr)
            return 1
        try:
            state = read_state(run_dir)
        except (FileNotFoundError, json.JSONDecodeError):
            state = {}
        if state.get("status") == "ready":
            print((run_dir / "supervisor.out").read_text(), end="")
            return 0
        time.sleep(0.1)
    print(f"epd up: not ready after {args.wait_s:.0f}s; stopping it. The supervisor said:", file=sys.stderr)
    print((run_dir / "supervisor.out").read_text()[-2000:], file=sys.stderr)   # a child's exits, with reasons
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait()
    return 1


# ---- down --------------------------------------------------------------------------------
def cmd_down(args) -> int:
    run_dir = current_run_dir(args.run_dir)
    try:
        state = read_state(run_dir)
    except FileNotFoundError as exc:
        print(f"epd down: {exc}", file=sys.stderr)
        return 1
    sup = state["supervisor_pid"]
    pids = [s["pid"] for s in state["services"] if s["pid"]]
    if _pid_alive(sup):
        os.kill(sup, signal.SIGTERM)
    # the supervisor drains wave by wave, each within the grace period (ops/launcher.py stop_waves)
    deadline = time.monotonic() + state.get("stop_timeout_s", state.get("grace_s", 10.0)) + args.margin_s
    while time.monotonic() < deadline and (_pid_alive(sup) or any(_pid_alive(p) for p in pids)):
        time.sleep(0.05)
    left = [p for p in pids if _pid_alive(p)]
    for pid in left:   # the supervisor died without cleaning up: do it ourselves
        os.kill(pid, signal.SIGKILL)
    if _pid_alive(sup):
        print(f"epd down: supervisor {sup} did not exit", file=sys.stderr)
        return 1
    print(f"epd: stack stopped ({len(pids)} services){'; killed ' + str(left) if left else ''}")
    return 0


# ---- status ------------------------------------------------------------------------------
def cmd_status(args) -> int:
    import zmq

    from messages.control import ServiceState
    from ops.control_client import query_status
    from services.runtime.curve import KEYS_ENV, KeysError, load_keys
    run_dir = current_run_dir(args.run_dir)
    try:
        state = read_state(run_dir)
    except FileNotFoundError as exc:
        print(f"epd status: {exc}", file=sys.stderr)
        return 1
    # CURVE keys: --keys for all; else each service's keys dir as the supervisor wrote it ("" =
    # plaintext); else (a state.json from before keys) EPD_KEYS_DIR
    dirs = {s["instance"]: args.keys if args.keys is not None else s.get("keys_dir", os.environ.get(KEYS_ENV, ""))
            for s in state["services"]}
    try:
        keys = {d: load_keys(d, server=False) for d in set(dirs.values()) if d}
    except KeysError as exc:
        print(f"epd status: {exc}", file=sys.stderr)
        return 2
    ctx = zmq.Context()
    replies = {s["instance"]: query_status(s["address"], args.timeout_s, ctx, keys.get(dirs[s["instance"]]))
               for s in state["services"]}
    ctx.term()
    heard = {}   # instance -> age of its last heartbeat as seen by the service it registered with
    for reply in replies.values():
        for peer in (reply.peers if reply else []):
            heard[peer.instance] = peer.last_heartbeat_age_s if peer.alive else float("inf")
    rows = []
    for svc in state["services"]:
        reply = replies[svc["instance"]]
        hb = heard.get(svc["instance"])
        exited = svc.get("exit_code") is not None
        rows.append({
            "instance": svc["instance"], "kind": svc["kind"], "pid": svc["pid"], "address": svc["address"],
            "state": ServiceState(reply.state).name.lower() if reply else _not_answering(svc),
            "uptime_s": reply.uptime_s if reply else None,
            "queue": reply.load.queue_depth if reply else None,
            "in_flight": reply.load.in_flight if reply else None,
            "kv_usage": reply.load.kv_usage if reply else None,   # workers: share of KV pages in use
            "peers": f"{sum(p.alive for p in reply.peers)}/{len(reply.peers)}" if reply else "-",
            "last_heartbeat": "-" if hb is None else ("dead" if hb == float("inf") else f"{hb:.1f}s ago"),
            "restarts": svc["restarts"], "gpu": "-" if svc.get("gpu") is None else svc["gpu"],   # topology `gpus`
            "last_exit": svc["exit_code"] if exited else "-", "exit_reason": svc.get("exit_reason", "")})
    if args.json:
        print(json.dumps({"supervisor": state["status"], "services": rows}, indent=1))
    else:
        print(f"stack: {state['status']}  (run dir {run_dir.resolve()})")
        cols = ("instance", "kind", "state", "pid", "uptime_s", "queue", "in_flight", "peers",
                "last_heartbeat", "restarts", "last_exit")
        if any(r["gpu"] != "-" for r in rows):   # a GPU-pinned topology: which GPU each instance sees
            cols = cols[:3] + ("gpu",) + cols[3:]
        widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in cols]
        print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
        for r in rows:
            print("  ".join(str(r[c]).ljust(w) for c, w in zip(cols, widths)))
        for r in rows:   # why a service is not running, as the supervisor saw its last exit
            if r["state"] != "running" and r["last_exit"] != "-":
                print(f"{r['instance']}: exited with code {r['last_exit']}: {r['exit_reason']}")
    return 0 if all(r["state"] == "running" for r in rows) else 3


def _not_answering(svc: dict) -> str:
    """The state of a service that did not answer, as the supervisor knows it: crashed and waiting out
    its restart back-off ("restarting"), stopped, or running but silent ("unreachable")."""
    return svc["state"] if svc.get("state") in ("restarting", "stopped", "killed") else "unreachable"


# ---- health ------------------------------------------------------------------------------
def cmd_health(args) -> int:
    from messages.control import ServiceState
    from ops.control_client import query_status, why_no_answer
    from services.runtime.curve import KeysError, keys_from_env
    address = args.address or os.environ.get("EPD_ADVERTISE") or os.environ.get("EPD_BIND", "")
    if not address:
        print("epd health: give --address (or set EPD_ADVERTISE)", file=sys.stderr)
        return 2
    try:   # a service's own EPD_KEYS_DIR (a container's health check) or --keys
        keys = keys_from_env(explicit=args.keys)
    except KeysError as exc:
        print(f"epd health: {exc}", file=sys.stderr)
        return 2
    address = address.replace("0.0.0.0", "127.0.0.1")
    status = query_status(address, args.timeout_s, keys=keys)
    if status is None:
        print(f"{address}: {why_no_answer(address, args.timeout_s, keys)}", file=sys.stderr)
        return 1
    print(f"{status.instance}: {ServiceState(status.state).name.lower()}")
    return 0 if status.state == ServiceState.RUNNING else 1


def register(subparsers) -> None:
    up = subparsers.add_parser("up", help="start the stack's services locally and supervise them")
    up.add_argument("--topology", help="topology file, or an embedded one by name: default (E/P/D, the default) "
                                       "or unified (gateway + one unified worker)")
    up.add_argument("--port-base", type=int, help="override the topology's first port")
    up.add_argument("--http-port", type=int, help="override the port of the HTTP API (the gateway's)")
    up.add_argument("--model", help="serve this model directory (V4 or V4.1) instead of the topology's; "
                                    "the API's model name is the directory's name")
    up.add_argument("--run-dir", help="where logs and state go (default .epd/runs/<time>)")
    up.add_argument("--detach", action="store_true", help="return once ready; stop later with `epd down`")
    up.add_argument("--wait-s", type=float, default=120.0, help="with --detach: how long to wait for ready")
    up.add_argument("--keys", metavar="DIR", help="CURVE keys (`epd keys`) for every service: encrypted, "
                                                  "authenticated links (default $EPD_KEYS_DIR; unset: plaintext)")
    up.set_defaults(func=cmd_up)

    down = subparsers.add_parser("down", help="drain and stop the running stack")
    down.add_argument("--run-dir")
    down.add_argument("--margin-s", type=float, default=10.0,
                      help="wait this long beyond the stop timeout (a grace period per stop wave)")
    down.set_defaults(func=cmd_down)

    status = subparsers.add_parser("status", help="each service's state, load and last heartbeat")
    status.add_argument("--run-dir")
    status.add_argument("--json", action="store_true")
    status.add_argument("--timeout-s", type=float, default=1.0)
    status.add_argument("--keys", metavar="DIR", help="CURVE client keys for every service (default: each one's "
                                                      "keys dir as state.json names it, else $EPD_KEYS_DIR)")
    status.set_defaults(func=cmd_status)

    health = subparsers.add_parser("health", help="exit 0 when the service at ADDRESS is running")
    health.add_argument("--address")
    health.add_argument("--timeout-s", type=float, default=2.0)
    health.add_argument("--keys", metavar="DIR",
                        help="CURVE client keys of the service's stack (default $EPD_KEYS_DIR)")
    health.set_defaults(func=cmd_health)
