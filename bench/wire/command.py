"""`epd bench wire`: what the runtime costs on top of ZeroMQ, in one run.

Over tcp loopback and ipc, for small messages (64-byte payload) and 1 MiB tensor frames, it
measures round-trip latency with one request outstanding (p50/p99) and throughput with a window
of requests outstanding (64 small, 8 large), for three clients:

  raw   the baseline: a plain blocking pyzmq loop, DEALER client -> ROUTER echo server in another
        process that sends back the frames it got. The client sends the very frames the runtime's
        Codec produces (encoded once), so both sides move the same bytes in the same frames, with
        the same copy semantics (copied below 64 KiB as pyzmq does, zero-copy for the 1 MiB frame).
  call  the runtime as services use it: a client Service's `call` -> the echo Service
        (`services.runtime.main echo`, uvloop) in another process.
  lean  the same echo Service driven by a lean client: the runtime's Codec and transport Link on
        uvloop, replies taken by a Link listener (no Service.call: no per-call future, timeout,
        metrics or dispatch). It shows what the runtime's wire layer costs without the shell.

The ratio table gives the runtime/raw ratios against the targets (<= 1.5x small, <= 1.1x 1 MiB):
latency x = runtime p50 / raw p50, overhead x = raw msg/s / runtime msg/s.

`--curve` measures every cell twice in the same run, CURVE off and on (keys made for the run with
`epd keys`' writer; both servers and all three clients encrypt, and the servers run ZAP as a
service's inbox does), and adds a table of CURVE's cost: on/off latency and off/on throughput,
baseline = the same cell with CURVE off.
"""
from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.wire.servers import HWM, Children
from bench.common.table import print_table, write_json

CELL_TIMEOUT_S = 60   # beyond the measurement itself: a silent server fails the bench, never hangs it
RAW_LABEL = "raw (blocking pyzmq)"
CLIENT_LABELS = {"raw": RAW_LABEL, "call": "runtime Service.call", "lean": "runtime lean (Codec+Link)"}


@dataclass(frozen=True)
class Size:
    name: str
    payload: int   # bytes of Echo.payload (inside the msgpack header)
    tensor: int    # bytes of the tensor frame after the header (0: none)
    window: int    # requests outstanding in the throughput test
    target: float  # largest acceptable runtime/raw ratio


SIZES = (Size("64B", 64, 0, 64, 1.5), Size("1MiB", 0, 1 << 20, 8, 1.1))
TRANSPORTS = ("tcp", "ipc")
CURVE_OFF, CURVE_ON = "off", "on"


def register(subparsers) -> None:
    parser = subparsers.add_parser("wire", help="runtime vs raw pyzmq: latency and throughput, tcp and ipc")
    parser.add_argument("--seconds", type=float, default=1.0, help="duration of each measurement (default 1)")
    parser.add_argument("--json", metavar="FILE", help="also write every number to FILE")
    parser.add_argument("--transport", choices=TRANSPORTS, action="append",
                        help="measure only this transport (repeatable; default both)")
    parser.add_argument("--curve", action="store_true",
                        help="measure every cell with CURVE off and on, and compare (baseline = off)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from services.runtime.logs import configure_logging
    if args.seconds <= 0:
        print("epd bench wire: --seconds must be > 0", file=sys.stderr)
        return 2
    configure_logging("warning")
    curve_modes = (CURVE_OFF, CURVE_ON) if args.curve else (CURVE_OFF,)
    rows = measure(tuple(args.transport or TRANSPORTS), args.seconds, curve_modes)
    ratios = compare(rows)
    curve_col = ["curve"] if args.curve else []
    print_table(["transport", "size", "client", *curve_col, "p50 us", "p99 us", "msg/s", "window"],
                [[r["transport"], r["size"], CLIENT_LABELS[r["client"]], *([r["curve"]] if args.curve else []),
                  r["p50_us"], r["p99_us"], r["msgs_per_s"], r["window"]] for r in rows],
                title=f"\nepd bench wire: {args.seconds:g} s per measurement; baseline = {RAW_LABEL}: a plain "
                      "blocking DEALER->ROUTER echo loop sending the runtime's own frames")
    print_table(["transport", "size", "runtime client", *curve_col, "latency x", "overhead x", "target", "verdict"],
                [[r["transport"], r["size"], CLIENT_LABELS[r["client"]], *([r["curve"]] if args.curve else []),
                  f"{r['latency_ratio']:.2f}x", f"{r['overhead']:.2f}x", f"<= {r['target']}x", _verdict(r)]
                 for r in ratios],
                title="\nruntime / raw  (latency x = p50 ratio, overhead x = raw msg/s / runtime msg/s; "
                      "raw and runtime with the same CURVE setting)")
    curve_costs = compare_curve(rows)
    if args.curve:
        print_table(["transport", "size", "client", "p50 off us", "p50 on us", "latency x",
                     "msg/s off", "msg/s on", "throughput x"],
                    [[c["transport"], c["size"], CLIENT_LABELS[c["client"]], c["p50_off_us"], c["p50_on_us"],
                      f"{c['latency_ratio']:.2f}x", c["msgs_per_s_off"], c["msgs_per_s_on"],
                      f"{c['throughput_ratio']:.2f}x"] for c in curve_costs],
                    title="\nCURVE on / off, same run  (latency x = p50 on / p50 off, "
                          "throughput x = msg/s off / msg/s on; baseline = CURVE off)")
    if args.json:
        write_json(args.json, "wire", {
            "seconds_per_measurement": args.seconds, "baseline": RAW_LABEL,
            "clients": CLIENT_LABELS, "sizes": [s.__dict__ for s in SIZES], "curve_modes": list(curve_modes),
            "results": rows, "ratios": ratios, "curve_costs": curve_costs})
    return 0


def _verdict(ratio: dict) -> str:
    missed = [name for name in ("latency", "throughput") if not ratio[f"{name}_ok"]]
    return "ok" if not missed else "MISS " + "+".join(missed)


def _curve(row: dict) -> str:
    return row.get("curve", CURVE_OFF)


def compare(rows: list[dict]) -> list[dict]:
    """Each runtime cell against the raw cell of its transport, size and CURVE setting."""
    raw = {(_curve(r), r["transport"], r["size"]): r for r in rows if r["client"] == "raw"}
    targets = {s.name: s.target for s in SIZES}
    ratios = []
    for r in rows:
        base = raw.get((_curve(r), r["transport"], r["size"]))
        if r["client"] == "raw" or base is None:
            continue
        latency, overhead = r["p50_us"] / base["p50_us"], base["msgs_per_s"] / r["msgs_per_s"]
        target = targets[r["size"]]
        ratios.append({"transport": r["transport"], "size": r["size"], "client": r["client"], "curve": _curve(r),
                       "latency_ratio": round(latency, 3), "overhead": round(overhead, 3), "target": target,
                       "latency_ok": latency <= target, "throughput_ok": overhead <= target})
    return ratios


def compare_curve(rows: list[dict]) -> list[dict]:
    """What CURVE costs each cell: the CURVE-on row against the same cell with CURVE off."""
    off = {(r["transport"], r["size"], r["client"]): r for r in rows if _curve(r) == CURVE_OFF}
    costs = []
    for r in rows:
        base = off.get((r["transport"], r["size"], r["client"]))
        if _curve(r) != CURVE_ON or base is None:
            continue
        costs.append({"transport": r["transport"], "size": r["size"], "client": r["client"],
                      "p50_off_us": base["p50_us"], "p50_on_us": r["p50_us"],
                      "msgs_per_s_off": base["msgs_per_s"], "msgs_per_s_on": r["msgs_per_s"],
                      "latency_ratio": round(r["p50_us"] / base["p50_us"], 3),
                      "throughput_ratio": round(base["msgs_per_s"] / r["msgs_per_s"], 3)})
    return costs


# ---- orchestration -----------------------------------------------------------------------
def measure(transports: tuple[str, ...], seconds: float, curve_modes: tuple[str, ...] = (CURVE_OFF,)) -> list[dict]:
    import uvloop
    from ops.keys_command import write_keys
    from services.runtime.curve import load_keys
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="epd-bench-") as tmp, Children(Path(tmp)) as children:
        keys = None
        if CURVE_ON in curve_modes:
            write_keys(Path(tmp) / "keys")
            keys = load_keys(Path(tmp) / "keys")
        for transport in transports:
            for curve in curve_modes:   # off and on of one transport back to back: the same machine state
                cell_keys = keys if curve == CURVE_ON else None
                keys_arg = [keys.directory] if cell_keys else []
                for size in SIZES:
                    address = _address(transport, tmp, f"raw-{size.name}-{curve}")
                    server = children.start(f"raw-{transport}-{size.name}-curve-{curve}",
                                            ["raw", address, "copy" if not size.tensor else "zerocopy", *keys_arg])
                    rows.append(_row(transport, size, "raw", curve, raw_cell(address, size, seconds, cell_keys)))
                    children.stop(server)
                address = _address(transport, tmp, f"runtime-{curve}")
                server = children.start(f"runtime-{transport}-curve-{curve}", ["runtime", address, *keys_arg])
                cells = uvloop.run(runtime_cells(address, f"ipc://{tmp}/client-{transport}-{curve}.sock", seconds,
                                                 cell_keys))
                rows += [_row(transport, size, client, curve, cell) for client, size, cell in cells]
                children.stop(server)
    return rows


def _row(transport: str, size: Size, client: str, curve: str, cell: dict) -> dict:
    return {"transport": transport, "size": size.name, "client": client, "curve": curve, "window": size.window,
            **cell}


def _address(transport: str, tmp: str, name: str) -> str:
    if transport == "ipc":
        return f"ipc://{tmp}/{name}.sock"
    with socket.socket() as s:   # a free port now; the server binds it a moment later
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


# ---- what is measured --------------------------------------------------------------------
def _message(size: Size):
    import numpy as np
    from messages.control import Echo
    buffers = [np.full(size.tensor, 7, dtype=np.uint8)] if size.tensor else []
    return Echo(payload=b"x" * size.payload), buffers


def _summary(samples_ns: list[int], replies: int, elapsed_s: float) -> dict:
    """Latency percentiles of the one-outstanding loop; throughput = replies completed in the window."""
    s = sorted(samples_ns)
    pick = lambda q: round(s[min(len(s) - 1, int(q * len(s)))] / 1e3, 2)   # noqa: E731
    return {"p50_us": pick(0.50), "p99_us": pick(0.99), "mean_us": round(sum(s) / len(s) / 1e3, 2),
            "latency_samples": len(s), "msgs_per_s": round(replies / elapsed_s, 1), "replies": replies}


def _warmup_s(seconds: float) -> float:
    return min(0.5, seconds / 4)


def raw_cell(address: str, size: Size, seconds: float, keys=None) -> dict:
    """Blocking pyzmq DEALER: the same frames the runtime's Codec makes, encoded once."""
    import zmq
    from messages import Codec
    from services.runtime.curve import connect_curve
    message, buffers = _message(size)
    frames = Codec("bench-raw").encode(message, buffers=buffers)
    copy = not size.tensor   # pyzmq's choice for small frames; zero-copy for the tensor frame
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    for opt, value in ((zmq.SNDHWM, HWM), (zmq.RCVHWM, HWM), (zmq.LINGER, 0), (zmq.RCVTIMEO, CELL_TIMEOUT_S * 1000)):
        sock.setsockopt(opt, value)
    if keys is not None:
        connect_curve(sock, keys)
    sock.connect(address)

    def receive() -> None:
        got = sock.recv_multipart(copy=copy)
        if len(got) != len(frames) or (size.tensor and got[-1].buffer.nbytes != size.tensor):
            raise RuntimeError("raw echo returned other frames than it was sent")

    def roundtrip() -> None:
        sock.send_multipart(frames, copy=copy)
        receive()

    clock = time.perf_counter_ns
    try:
        _latency_loop(roundtrip, _warmup_s(seconds))
        samples = _latency_loop(roundtrip, seconds)
        start = clock()
        end = start + int(seconds * 1e9)
        for _ in range(size.window):
            sock.send_multipart(frames, copy=copy)
        replies = 0
        while True:
            receive()
            if clock() > end:
                break
            replies += 1
            sock.send_multipart(frames, copy=copy)
        for _ in range(size.window - 1):   # drain what is still outstanding
            receive()
    finally:
        sock.close(0)
        ctx.term()
    return _summary(samples, replies, seconds)


def _latency_loop(roundtrip, seconds: float) -> list[int]:
    clock, samples = time.perf_counter_ns, []
    end = clock() + int(seconds * 1e9)
    while True:
        t0 = clock()
        roundtrip()
        t1 = clock()
        samples.append(t1 - t0)
        if t1 >= end:
            return samples


async def runtime_cells(address: str, client_bind: str, seconds: float, keys=None) -> list[tuple[str, Size, dict]]:
    """Service.call from a client Service, then the lean client, against the echo Service."""
    from services.runtime.config import ServiceConfig
    from services.runtime.service import Service
    from messages.control import ServiceState
    client = Service(ServiceConfig(kind="echo", instance="bench-client", bind=client_bind,
                                   keys_dir=keys.directory if keys else ""))
    runner = asyncio.get_running_loop().create_task(client.run(install_signals=False))
    while client.state != ServiceState.RUNNING:
        if runner.done():
            raise RuntimeError(f"bench client service did not start (exit {runner.result()})")
        await asyncio.sleep(0.01)
    cells = []
    try:
        limit = CELL_TIMEOUT_S + 4 * seconds
        for size in SIZES:
            cells.append(("call", size, await asyncio.wait_for(_call_cell(client, address, size, seconds), limit)))
        for size in SIZES:
            cells.append(("lean", size, await asyncio.wait_for(_lean_cell(address, size, seconds, keys), limit)))
    finally:
        client.stop()
        await runner
    return cells


def _check_reply(envelope, size: Size) -> None:
    if size.tensor:
        if envelope.frame(0)[1].nbytes != size.tensor:
            raise RuntimeError("echo returned another tensor than it was sent")
    elif len(envelope.message.payload) != size.payload:
        raise RuntimeError("echo returned another payload than it was sent")


async def _call_cell(client, address: str, size: Size, seconds: float) -> dict:
    message, buffers = _message(size)

    async def roundtrip() -> None:
        _check_reply(await client.call(address, message, buffers=buffers), size)

    await _async_latency_loop(roundtrip, _warmup_s(seconds))
    samples = await _async_latency_loop(roundtrip, seconds)
    clock, replies = time.perf_counter_ns, 0
    end = clock() + int(seconds * 1e9)

    async def caller() -> None:
        nonlocal replies
        while True:
            await roundtrip()
            if clock() > end:
                return
            replies += 1

    await asyncio.gather(*(caller() for _ in range(size.window)))
    return _summary(samples, replies, seconds)


async def _async_latency_loop(roundtrip, seconds: float) -> list[int]:
    clock, samples = time.perf_counter_ns, []
    end = clock() + int(seconds * 1e9)
    while True:
        t0 = clock()
        await roundtrip()
        t1 = clock()
        samples.append(t1 - t0)
        if t1 >= end:
            return samples


async def _lean_cell(address: str, size: Size, seconds: float, keys=None) -> dict:
    """The runtime's Codec and Link without Service: encode, send; the Link's listener decodes each
    reply, matches it to a request sent and checks it (no per-call future or timeout, no metrics)."""
    import zmq
    from messages import Codec
    from messages.envelope import new_msg_id
    from services.runtime.transport import Link
    message, buffers = _message(size)
    codec = Codec("bench-lean")
    ctx = zmq.Context()
    link = Link(ctx, address, HWM, keys)
    loop, clock = asyncio.get_running_loop(), time.perf_counter_ns
    pending: set[str] = set()
    run = {"waiter": None, "pipelined": False, "end": 0, "replies": 0}

    def send() -> None:
        msg_id = new_msg_id()
        link.send(codec.encode(message, buffers=buffers, msg_id=msg_id))
        pending.add(msg_id)

    def on_reply(frames: list) -> None:
        waiter = run["waiter"]
        try:
            envelope = codec.decode(frames)
            pending.remove(envelope.header.in_reply_to)   # KeyError: a reply to nothing we sent
            _check_reply(envelope, size)
            if run["pipelined"]:   # one reply in, one request out, until the end; then drain
                if clock() <= run["end"]:
                    run["replies"] += 1
                    send()
                    return
                if pending:
                    return
            waiter.set_result(None)
        except Exception as exc:
            if not waiter.done():
                waiter.set_exception(exc)

    async def roundtrip() -> None:
        run["waiter"] = loop.create_future()
        send()
        await run["waiter"]

    link.listen(on_reply)
    try:
        await _async_latency_loop(roundtrip, _warmup_s(seconds))
        samples = await _async_latency_loop(roundtrip, seconds)
        run.update(waiter=loop.create_future(), pipelined=True, end=clock() + int(seconds * 1e9))
        for _ in range(size.window):
            send()
        await run["waiter"]
    finally:
        link.close(0)
        ctx.term()
    return _summary(samples, run["replies"], seconds)
