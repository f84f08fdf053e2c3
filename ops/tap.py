"""`epd tap ADDRESS [--forward UPSTREAM]`: print every frame set that arrives at ADDRESS.

The tap binds a ROUTER and decodes what it receives with the plain `msgpack` package, not the
service codec, so it shows malformed input too (as hex, with the reason) instead of rejecting
it. With `--forward`, it is a man-in-the-middle: each client identity gets its own DEALER to
UPSTREAM, requests are relayed there and replies relayed back, and both directions are printed.
Point a service's upstream (or a client) at the tap to watch a link. On a CURVE stack (`--keys DIR`
or EPD_KEYS_DIR) the tap serves and relays with the stack's keys, so it sees the plaintext: it
needs the server secret key, like any service of the stack.

`describe_frames` is a pure function (frames -> lines); `Tap` is the asyncio shell.
"""
from __future__ import annotations

import asyncio
import errno
import os
import sys
import time
from typing import TextIO

import msgpack
import zmq
import zmq.asyncio

from services.runtime.curve import (KEYS_ENV, CurveKeys, KeysError, connect_curve, load_keys, serve_curve,
                                   start_authenticator, stop_authenticator)

HEADER_FIELDS = ("version", "msg_id", "request_id", "traceparent", "sender", "sent_at", "tensors", "body",
                 "in_reply_to")
SHOWN_HEADER_FIELDS = ("version", "msg_id", "request_id", "traceparent", "sender", "sent_at", "in_reply_to")
HEX_BYTES = 48          # bytes of a malformed frame shown as hex
BYTES_SHOWN = 32        # bytes of a bytes value shown inside a body
HWM = 1000
MAX_CLIENTS = 256       # DEALERs to the upstream, one per client identity
CLOSE_LINGER_MS = 1000  # time for the last relayed frames to leave on exit


class TapError(Exception):
    """The tap cannot start (bad address, address in use)."""


# ---- decoding (pure) -------------------------------------------------------------------------
def _hex(frame: bytes) -> str:
    shown = frame[:HEX_BYTES].hex(" ")
    return f"{shown} ... ({len(frame)} bytes)" if len(frame) > HEX_BYTES else f"{shown or '(empty)'} ({len(frame)} bytes)"


class _Elided(str):
    """Text that prints without quotes inside a repr'd body (a truncated bytes value)."""

    def __repr__(self) -> str:
        return str(self)


def _short(value):
    """A body value made printable: long bytes truncated, nested containers walked."""
    if isinstance(value, (bytes, bytearray)):
        head = bytes(value[:BYTES_SHOWN])
        return head if len(value) <= BYTES_SHOWN else _Elided(f"{head!r}...({len(value)} bytes)")
    if isinstance(value, list):
        return [_short(v) for v in value]
    if isinstance(value, dict):
        return {k: _short(v) for k, v in value.items()}
    return value


def _zip_fields(value, info):
    """Arrays of array_like structs turned into {field: value}, as deep as msgspec's type info goes."""
    import msgspec.inspect as mi
    if isinstance(info, mi.StructType) and isinstance(value, list):
        named = {f.name: _zip_fields(v, f.type) for f, v in zip(info.fields, value)}
        named.update({f"_extra{i}": v for i, v in enumerate(value[len(info.fields):])})
        return named
    if isinstance(info, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)) and isinstance(value, list):
        return [_zip_fields(v, info.item_type) for v in value]
    if isinstance(info, mi.UnionType):
        structs = [t for t in info.types if isinstance(t, mi.StructType)]
        return _zip_fields(value, structs[0]) if len(structs) == 1 else value
    return value


def message_name(tag: int, types: dict | None = None) -> str:
    if types is None:
        from messages.registry import message_types
        types = message_types()
    cls = types.get(tag)
    return cls.__name__ if cls is not None else "UNKNOWN"


def _named_body(body, cls) -> object:
    if cls is None:
        return body
    import msgspec.inspect as mi
    try:
        return _zip_fields(body, mi.type_info(cls))
    except (TypeError, ValueError):   # a type msgspec cannot describe: show the raw decode
        return body


def _buffer_line(index: int, desc, frame: bytes) -> str:
    from messages.tensors import TensorDesc
    size = len(frame)
    if desc is None:
        return f"buffer[{index}]: no TensorDesc in the header, {size} bytes"
    try:
        dtype, shape = desc
        expected = TensorDesc(str(dtype), tuple(shape)).nbytes()
    except (TypeError, ValueError, KeyError) as exc:
        return f"buffer[{index}]: bad TensorDesc {desc!r} ({type(exc).__name__}: {exc}), {size} bytes"
    note = "" if expected == size else f"  MISMATCH: descriptor needs {expected} bytes"
    return f"buffer[{index}]: {dtype}{list(shape)} {size} bytes{note}"


def _unpack(frame: bytes):
    """(value, None) or (None, reason): msgpack decoding that never raises."""
    try:
        return msgpack.unpackb(frame, raw=False, strict_map_key=False, unicode_errors="backslashreplace"), None
    except (ValueError, TypeError, msgpack.UnpackException) as exc:   # ExtraData, FormatError, unhashable keys
        return None, f"{type(exc).__name__}: {exc}"


def describe_frames(frames: list[bytes], types: dict | None = None) -> tuple[str, list[str]]:
    """A compact summary and indented detail lines for one frame set `[tag, header, *buffers]`.

    Never raises on bad input: whatever cannot be decoded is shown as hex with the reason, and
    the summary then starts with MALFORMED."""
    from messages.envelope import SCHEMA_VERSION
    if types is None:
        from messages.registry import message_types
        types = message_types()
    frames = [bytes(f) for f in frames]
    if len(frames) < 2:
        return (f"MALFORMED {len(frames)} frame(s), expected at least 2 (tag, header)",
                [f"frame[{i}]: {_hex(f)}" for i, f in enumerate(frames)])
    tag_frame, header_frame, buffers = frames[0], frames[1], frames[2:]
    problems: list[str] = []
    tag = int.from_bytes(tag_frame, "big") if len(tag_frame) == 2 else None
    if tag is None:
        problems.append(f"tag: must be 2 bytes, got {_hex(tag_frame)}")
    header, reason = _unpack(header_frame)
    if reason is None and not (isinstance(header, list) and 8 <= len(header) <= 9):
        reason = f"expected an array of 8 or 9 fields, got {_short(header)!r}"
    if reason is not None:
        problems.append(f"header: {reason}: {_hex(header_frame)}")
    fields = dict(zip(HEADER_FIELDS, header)) if reason is None else {}
    name = message_name(tag, types) if tag is not None else "?"
    summary = [f"{name}({tag:#06x})" if tag is not None else name]
    details: list[str] = []
    if fields:
        summary += [f"req={fields['request_id'] or '-'}", f"from={fields['sender'] or '-'}", f"msg={fields['msg_id']}"]
        if fields.get("in_reply_to"):
            summary.append(f"reply_to={fields['in_reply_to']}")
        details.append("header: " + " ".join(f"{k}={fields.get(k, '')!r}" for k in SHOWN_HEADER_FIELDS))
        if fields["version"] != SCHEMA_VERSION:
            problems.append(f"schema version {fields['version']!r}, this build speaks {SCHEMA_VERSION}")
        details.append(f"body: {_short(_named_body(fields['body'], types.get(tag)))!r}")
    descs = fields.get("tensors") if isinstance(fields.get("tensors"), list) else []
    if fields and len(descs) != len(buffers):
        problems.append(f"header describes {len(descs)} buffers, {len(buffers)} arrived")
    for i, frame in enumerate(buffers):
        line = _buffer_line(i, descs[i] if i < len(descs) else None, frame)
        details.append(line)
        if "MISMATCH" in line or "bad TensorDesc" in line:
            problems.append(f"buffer[{i}] does not match its TensorDesc")
    summary.append(f"{len(buffers)} buf {sum(len(f) for f in buffers)} B" if buffers else "no buffers")
    if problems:
        summary.insert(0, "MALFORMED")
    return " ".join(summary), [f"problem: {p}" for p in problems] + details


# ---- the asyncio shell -----------------------------------------------------------------------
class Tap:
    """Binds a ROUTER at `address`; prints each frame set to `out`; relays to `forward` if set.

    `count` > 0 stops after that many frame sets (requests and replies both count)."""

    def __init__(self, address: str, *, forward: str = "", count: int = 0, out: TextIO | None = None,
                 detail: bool = True, keys: CurveKeys | None = None):
        self.address = address
        self.keys = keys
        self.forward = forward
        self.count = count
        self.out = out or sys.stdout
        self.detail = detail
        self.seen = 0
        self.bound = ""
        self._ctx: zmq.asyncio.Context | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._dealers: dict[bytes, zmq.asyncio.Socket] = {}
        self._readers: list[asyncio.Task] = []
        self._done: asyncio.Event | None = None
        self._types: dict | None = None
        self._authenticator = None

    def open(self) -> str:
        """Bind (synchronously, so clients may connect at once); returns the bound endpoint."""
        import messages  # noqa: F401  (registers every message type)
        from messages.registry import message_types
        self._types = message_types()
        self._ctx = zmq.asyncio.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        for option, value in ((zmq.SNDHWM, HWM), (zmq.RCVHWM, HWM), (zmq.LINGER, CLOSE_LINGER_MS),
                              (zmq.ROUTER_MANDATORY, 1)):
            self._router.setsockopt(option, value)
        try:
            if self.keys is not None:
                self._authenticator = start_authenticator(self._ctx, self.keys)
                serve_curve(self._router, self.keys)
            self._router.bind(self.address)
        except zmq.ZMQError as exc:
            self.close()
            raise TapError(f"cannot bind {self.address}: {exc}") from None
        except KeysError as exc:   # keys without the server secret: a tap serves, so it needs it
            self.close()
            raise TapError(str(exc)) from None
        self.bound = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.bound

    async def run(self) -> int:
        """Serve until `count` frame sets were seen (forever when 0); returns how many were seen."""
        if self._router is None:
            self.open()
        self._done = asyncio.Event()
        reader = asyncio.get_running_loop().create_task(self._read_clients())
        try:
            await self._done.wait()
        finally:
            for task in [reader, *self._readers]:
                task.cancel()
            await asyncio.gather(reader, *self._readers, return_exceptions=True)
            self.close()
        return self.seen

    def close(self) -> None:
        for sock in [*self._dealers.values(), self._router]:
            if sock is not None:
                sock.close()
        self._dealers.clear()
        self._router = None
        if self._authenticator is not None:   # its thread uses sockets of the context: stop it before term()
            stop_authenticator(self._authenticator)
            self._authenticator = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def _read_clients(self) -> None:
        while True:
            identity, *frames = await self._router.recv_multipart()
            if self._done.is_set():     # arrived after the last counted frame set: not ours to relay
                return
            note = self._relay_up(identity, frames) if self.forward else ""
            self._show("->", identity, frames, note)

    async def _read_upstream(self, identity: bytes, dealer: zmq.asyncio.Socket) -> None:
        while True:
            frames = await dealer.recv_multipart()
            if self._done.is_set():
                return
            note = self._send(self._router, [identity, *frames], f"client {identity.hex()}")
            self._show("<-", identity, frames, note)

    def _relay_up(self, identity: bytes, frames: list[bytes]) -> str:
        dealer = self._dealers.get(identity)
        if dealer is None:
            if len(self._dealers) >= MAX_CLIENTS:
                return f"NOT RELAYED: {MAX_CLIENTS} clients already"
            dealer = self._dealers[identity] = self._ctx.socket(zmq.DEALER)
            for option, value in ((zmq.SNDHWM, HWM), (zmq.RCVHWM, HWM), (zmq.LINGER, CLOSE_LINGER_MS)):
                dealer.setsockopt(option, value)
            if self.keys is not None:
                connect_curve(dealer, self.keys)
            dealer.connect(self.forward)
            self._readers.append(asyncio.get_running_loop().create_task(self._read_upstream(identity, dealer)))
        return self._send(dealer, frames, self.forward)

    @staticmethod
    def _send(sock: zmq.asyncio.Socket, frames: list[bytes], where: str) -> str:
        """Send without blocking; a note saying why the frames did not go, or ""."""
        try:
            sock.send_multipart(frames, flags=zmq.DONTWAIT).result()
        except zmq.Again:
            return f"NOT RELAYED: send queue to {where} full"
        except zmq.ZMQError as exc:
            if exc.errno == errno.EHOSTUNREACH:
                return f"NOT RELAYED: {where} is gone"
            return f"NOT RELAYED: {exc}"
        return ""

    def _show(self, arrow: str, identity: bytes, frames: list[bytes], note: str) -> None:
        self.seen += 1
        summary, details = describe_frames(frames, self._types)
        clock = time.strftime("%H:%M:%S", time.localtime()) + f".{int(time.time() * 1000) % 1000:03d}"
        lines = [f"{clock} #{self.seen} {arrow} {identity.hex() or '-'} {summary}" + (f"  [{note}]" if note else "")]
        if self.detail:
            lines += [f"    {line}" for line in details]
        self.out.write("\n".join(lines) + "\n")
        self.out.flush()
        if self.count and self.seen >= self.count:
            self._done.set()


async def tap(address: str, *, forward: str = "", count: int = 0, out: TextIO | None = None,
              detail: bool = True, keys: CurveKeys | None = None) -> int:
    """Run a tap in this event loop; returns the number of frame sets seen."""
    return await Tap(address, forward=forward, count=count, out=out, detail=detail, keys=keys).run()


async def _serve(args) -> int:
    keys_dir = args.keys if args.keys is not None else os.environ.get(KEYS_ENV, "")
    try:
        keys = load_keys(keys_dir) if keys_dir else None
    except KeysError as exc:
        print(f"epd tap: {exc}", file=sys.stderr)
        return 2
    instance = Tap(args.address, forward=args.forward or "", count=args.count, detail=not args.brief, keys=keys)
    try:
        bound = instance.open()
    except TapError as exc:
        print(f"epd tap: {exc}", file=sys.stderr)
        return 2
    relay = f", relaying to {args.forward}" if args.forward else ""
    curve = f" (CURVE, keys {keys.directory})" if keys else ""
    print(f"tap listening on {bound}{relay}{curve}", flush=True)
    await instance.run()
    return 0


def run(args) -> int:
    if args.count < 0:
        print("epd tap: --count must be >= 0", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_serve(args))
    except KeyboardInterrupt:
        return 130


def register(subparsers) -> None:
    parser = subparsers.add_parser("tap", help="print (and optionally relay) every frame set sent to an address")
    parser.add_argument("address", metavar="ADDRESS", help="where to bind, e.g. tcp://0.0.0.0:5600 or ipc:///tmp/tap")
    parser.add_argument("--forward", metavar="UPSTREAM", help="relay to this service and print its replies too")
    parser.add_argument("--count", type=int, default=0, metavar="N", help="stop after N frame sets (0: run forever)")
    parser.add_argument("--brief", action="store_true", help="one line per frame set, no detail lines")
    parser.add_argument("--keys", metavar="DIR",
                        help="the stack's CURVE keys (default $EPD_KEYS_DIR; unset: plaintext)")
    parser.set_defaults(func=run)
