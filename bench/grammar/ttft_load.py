"""The grammar traffic of `epd bench grammar --ttft`: K GrammarCompile requests kept in flight at the
compiler replicas, each a heavy constraint no cache holds.

The constraint is a closed json_schema object of `properties` required integer properties whose
names carry a salt unique to the request (and to this bench run), so every request is a cold
compile: ~0.6 s at 6,000 properties on the 2-core box (llguidance 1.9.1; the grammar text is ~300 KB).
Required, not optional, properties: llguidance refuses objects of more than ~500 optional
properties at its parser's row limit (fast, ~0.1 s: an error, not a heavy compile).

CompileLoad runs on a thread of its own with a plain DEALER per replica speaking our envelope, so
the HTTP client's event loop that times the plain requests never handles a compile reply. A new
request goes to the replica with the fewest in flight as soon as one is answered. Against a CURVE
stack (EPD_KEYS_DIR set) the DEALERs are CURVE clients with the stack's client keys.
"""
from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field

SALT = "@@SALT@@"
REPLY_GRACE_S = 30.0          # beyond the compiler's own hard limit: a reply this late means a dead peer


def heavy_constraint_template(properties: int) -> str:
    """The constraint JSON with SALT where each request's salt goes (a replace, not a rebuild:
    building 6,000 properties per request would hold the GIL for milliseconds)."""
    from messages.grammar import constraint_json
    names = [f"{SALT}_{i}" for i in range(properties)]
    schema = {"type": "object", "properties": {n: {"type": "integer"} for n in names}, "required": names,
              "additionalProperties": False}
    return constraint_json({"kind": "json_schema", "schema": schema, "strict": True})


@dataclass
class LoadWindow:
    """What one window of grammar load did."""
    sent: int = 0
    latencies_s: list[float] = field(default_factory=list)       # send -> GrammarCompiled, client side
    compile_ms: list[float] = field(default_factory=list)        # as the compiler reports it
    cached: int = 0                                              # a salted constraint from the cache: a bug
    errors: dict[str, int] = field(default_factory=dict)         # ErrorReply code -> count
    wall_s: float = 0.0

    @property
    def done(self) -> int:
        return len(self.latencies_s)

    def row(self) -> dict:
        return {"sent": self.sent, "done": self.done, "cached": self.cached, "errors": dict(self.errors),
                "wall_s": round(self.wall_s, 3), "latency_ms": [round(x * 1e3, 2) for x in self.latencies_s],
                "compile_ms": [round(x, 2) for x in self.compile_ms]}


class CompileLoad:
    """`start()` begins keeping `in_flight` compiles outstanding; `stop()` sends no more, waits for
    the outstanding ones and returns the window."""

    def __init__(self, addresses: list[str], tokenizer_id: str, properties: int, in_flight: int,
                 reply_timeout_s: float) -> None:
        if not addresses:
            raise ValueError("no grammar compiler in the stack")
        self.addresses = list(addresses)
        self.tokenizer_id = tokenizer_id
        self.template = heavy_constraint_template(properties)
        self.in_flight = in_flight
        self.reply_timeout_s = reply_timeout_s + REPLY_GRACE_S
        self.run_salt = secrets.token_hex(4)   # a long-lived compiler's cache may hold an earlier run's
        self._sequence = 0
        self._thread: threading.Thread | None = None
        self._loaded = threading.Event()
        self._stop = threading.Event()
        self._result: LoadWindow | None = None
        self._error: BaseException | None = None

    def start(self) -> None:
        """Returns once the first `in_flight` requests are sent (the compilers are busy from here)."""
        self._loaded.clear()
        self._stop.clear()
        self._result, self._error = None, None
        self._thread = threading.Thread(target=self._run_guarded, name="bench-compile-load", daemon=True)
        self._thread.start()
        self._loaded.wait()
        if self._error is not None:
            raise self._error

    def stop(self) -> LoadWindow:
        self._stop.set()
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"the compile load failed: {self._error}") from self._error
        return self._result

    def _run_guarded(self) -> None:
        try:
            self._result = self._run()
        except BaseException as exc:   # handed to start() / stop(), which raise it
            self._error = exc
        finally:
            self._loaded.set()

    def _run(self) -> LoadWindow:
        import zmq
        from messages import Codec
        from messages.errors import ErrorReply
        from messages.grammar import GrammarCompiled
        from services.runtime.curve import connect_curve, keys_from_env
        keys = keys_from_env()
        ctx = zmq.Context()
        codec = Codec(sender="bench-grammar-load")
        sockets = []
        for address in self.addresses:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if keys is not None:
                connect_curve(sock, keys)
            sock.connect(address)
            sockets.append(sock)
        poller = zmq.Poller()
        for sock in sockets:
            poller.register(sock, zmq.POLLIN)
        window, pending = LoadWindow(), {}   # request id -> (socket index, sent at)
        started = time.perf_counter()
        try:
            while len(pending) < self.in_flight:
                self._send(codec, sockets, pending, window)
            self._loaded.set()
            while pending:
                ready = dict(poller.poll(timeout=1000))   # a stop needs no wake-up: it only ends the resending
                for index, sock in enumerate(sockets):
                    if sock not in ready:
                        continue
                    while sock.poll(0):
                        envelope = codec.decode(sock.recv_multipart())
                        sent = pending.pop(envelope.request_id, None)
                        if sent is None:
                            continue
                        self._record(envelope.message, time.perf_counter() - sent[1], window,
                                     GrammarCompiled, ErrorReply)
                        if not self._stop.is_set():
                            self._send(codec, sockets, pending, window)
                oldest = min((at for _, at in pending.values()), default=None)
                if oldest is not None and time.perf_counter() - oldest > self.reply_timeout_s:
                    raise RuntimeError(f"a GrammarCompile got no reply in {self.reply_timeout_s:g} s")
        finally:
            window.wall_s = time.perf_counter() - started
            for sock in sockets:
                sock.close(0)
            ctx.term()
        return window

    def _send(self, codec, sockets, pending: dict, window: LoadWindow) -> None:
        from messages.grammar import GrammarCompile
        self._sequence += 1
        salt = f"s{self.run_salt}n{self._sequence}"
        counts = [0] * len(sockets)
        for index, _ in pending.values():
            counts[index] += 1
        index = counts.index(min(counts))
        message = GrammarCompile(self.template.replace(SALT, salt), self.tokenizer_id)
        sockets[index].send_multipart(codec.encode(message, request_id=salt))
        pending[salt] = (index, time.perf_counter())
        window.sent += 1

    @staticmethod
    def _record(message, seconds: float, window: LoadWindow, compiled_type, error_type) -> None:
        if isinstance(message, compiled_type):
            window.latencies_s.append(seconds)
            window.compile_ms.append(message.compile_ms)
            window.cached += message.cached
        elif isinstance(message, error_type):
            name = _code_name(message.code)
            window.errors[name] = window.errors.get(name, 0) + 1
        else:
            raise RuntimeError(f"a GrammarCompile was answered with {type(message).__name__}")


def _code_name(code: int) -> str:
    from messages.errors import ErrorCode
    try:
        return ErrorCode(code).name
    except ValueError:
        return str(code)
