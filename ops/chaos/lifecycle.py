"""Lifecycle scenarios: a stack-wide stop while requests stream (drain), and a service that
cannot bind its port (bind_fail)."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

from ops.chaos.client import Flight
from ops.chaos.runner import Context, check_streams, fill_row, send_all, stream_bodies
from ops.chaos.table import Row

DRAIN_STREAMS = 5
ERROR_STORM = 50                # error/warning log lines during a stop that count as a storm
BIND_TARGET = "swa_registry"    # restarts fast and holds no request state
BIND_EXIT_S = 15.0              # how long a service that cannot bind may take to exit
REPORT_S = 5.0                  # ... and the supervisor to log that exit


async def drain(ctx: Context) -> list[Row]:
    """5 streams, then `epd down`: all 5 complete within the grace period, no error storm. This
    stops the stack: `epd chaos` runs it last."""
    row = Row("drain")
    grace_s = ctx.stack.state().get("grace_s", 10.0)
    bodies = stream_bodies(ctx, "drain", count=DRAIN_STREAMS, max_tokens=96)
    async with ctx.http() as http:
        flight = Flight(http, ctx.url(), bodies)
        if not await flight.wait_for(lambda: flight.streaming(2) == DRAIN_STREAMS, 60.0):
            row.notes.append(f"only {flight.streaming(2)} of {DRAIN_STREAMS} were streaming at `epd down`")
        down_wall, down_at = time.time(), time.monotonic()
        stopping = asyncio.create_task(asyncio.to_thread(ctx.stack.down))
        results = await flight.results()
        ended = time.monotonic() - down_at
        down = await stopping
    fill_row(row, results, None)
    check_streams(row)
    row.notes.append(f"epd down exited {down.returncode} after {time.monotonic() - down_at:.1f} s; "
                     f"the streams ended {ended:.1f} s after it began (grace {grace_s:g} s)")
    row.check(down.returncode == 0, f"epd down failed: {(down.stdout + down.stderr).strip()[-300:]}")
    row.check(ended <= grace_s, f"streams ended {ended:.1f} s after `epd down`, past the {grace_s:g} s grace")
    noisy = [line for line in ctx.stack.log_lines(down_wall) if line.get("level") in ("error", "warning")]
    by_event: dict[str, int] = {}
    for line in noisy:
        key = f"{line['_file'].removesuffix('.log')}:{line.get('event')}"
        by_event[key] = by_event.get(key, 0) + 1
    top = sorted(by_event.items(), key=lambda kv: -kv[1])[:5]
    row.notes.append(f"{len(noisy)} error/warning log lines during the stop; most: {top}")
    row.check(len(noisy) <= ERROR_STORM, f"error storm: {len(noisy)} error/warning lines (limit {ERROR_STORM})")
    return [row]


async def bind_fail(ctx: Context) -> list[Row]:
    """Kill the SWA registry and hold its port before the supervisor restarts it: the new process
    must exit non-zero with a clear message, the supervisor must report the exit, and once the
    port is free again the stack recovers."""
    row = Row("bind_fail")
    stack = ctx.stack
    victim = stack.services(BIND_TARGET)[0]
    instance, port = victim["instance"], int(victim["address"].rpartition(":")[2])
    wall = time.time()
    killed = stack.signal(instance, signal.SIGKILL)
    holder = await asyncio.to_thread(_hold_port, port, 5.0)
    if not row.check(holder is not None, f"could not take port {port} after killing {instance}"):
        return [row]
    try:
        new_pid = await asyncio.to_thread(_new_pid, stack, instance, killed, 15.0)
        row.check(new_pid is not None, f"the supervisor did not restart {instance} within 15 s")
        if new_pid:
            exited = await asyncio.to_thread(_wait_exit, new_pid, BIND_EXIT_S)
            if not row.check(exited, f"{instance} (pid {new_pid}) could not bind port {port} and did not exit "
                                     f"within {BIND_EXIT_S:g} s"):
                os.kill(new_pid, signal.SIGKILL)      # left hanging it is never restarted
            await asyncio.to_thread(_check_reports, row, stack, instance, port, wall)
    finally:
        holder.close()
    took = await asyncio.to_thread(stack.wait_restarted, instance, new_pid or killed, ctx.recover_s)
    row.check(took is not None, f"{instance} did not run again within {ctx.recover_s:g} s of the port's release")
    healthy = await asyncio.to_thread(stack.wait_healthy, ctx.recover_s)
    row.check(healthy, f"the stack was not healthy after the port was released (not ready: {stack.not_ready()})")
    after = await send_all(ctx, stream_bodies(ctx, "bind", count=1, max_tokens=8))
    fill_row(row, after, None)
    check_streams(row)
    return [row]


def _check_reports(row: Row, stack, instance: str, port: int, since: float) -> None:
    """The service's own log says why (its port, in use), and the supervisor reports a non-zero
    exit of it other than our SIGKILL (polled: it logs the exit once it reaps the process)."""
    deadline, exits = time.monotonic() + REPORT_S, []
    while not exits and time.monotonic() < deadline:
        lines = stack.log_lines(since)
        exits = [line for line in lines if line.get("event") == "service.exited" and line.get("instance") == instance
                 and line.get("code") not in (0, None, -signal.SIGKILL)]
        time.sleep(0.1)
    own = [line for line in lines if line["_file"] == f"{instance}.log" and line.get("level") in ("error", "critical")]
    clear = [line for line in own if str(port) in str(line) and "in use" in str(line).lower()]
    row.notes.append(f"{instance}'s error lines: {[line.get('event') for line in own][:5]}; "
                     f"first: {str(own[0].get('error', own[0]))[:120] if own else '-'}")
    row.check(bool(clear), f"{instance}'s log has no error naming port {port} as in use")
    row.notes += [f"supervisor: service.exited code {line.get('code')}: {str(line.get('reason'))[:120]}"
                  for line in exits[:2]]
    row.check(bool(exits), f"the supervisor reported no non-zero exit of {instance} within {REPORT_S:g} s")


def _hold_port(port: int, timeout_s: float) -> socket.socket | None:
    """A listening socket on the port (SO_REUSEADDR: the dead process's TIME_WAIT does not block it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen()
            return sock
        except OSError:
            sock.close()
            time.sleep(0.01)
    return None


def _new_pid(stack, instance: str, old: int, timeout_s: float) -> int | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pid = stack.service(instance)["pid"]
        if pid and pid != old:
            return pid
        time.sleep(0.05)
    return None


def _wait_exit(pid: int, timeout_s: float) -> bool:
    """True once the process is gone or a zombie (its parent, the supervisor, reaps it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(") ", 1)[1][0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False
